/* Decode attention straight from the paged KV pool: one query token per sequence,
 * keys and values read in place from their blocks (no gather), online softmax.
 *
 * Pool layout (see kv_pool.py): [num_blocks, num_layers, 2, block_size, kv_heads, head_dim].
 * q, out: [batch, q_heads, head_dim]. Tables: [batch, max_blocks] block ids; lens: [batch].
 * Each (sequence, kv head) pair is one task; its q_heads / kv_heads query heads share
 * every key and value read. float32 or bfloat16 storage, float32 arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((v.u >> 16) | 0x40);  /* NaN */
    uint32_t rounding = 0x7fff + ((v.u >> 16) & 1);
    return (uint16_t)((v.u + rounding) >> 16);
}

static inline void load_row(const void *base, int64_t index, int dim, int bf16, float *dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)base + index, sizeof(float) * dim);
    }
}

int paged_decode_attention(
    const void *q, const void *pool, const int64_t *tables, const int64_t *lens, void *out,
    int batch, int q_heads, int kv_heads, int head_dim, int block_size, int num_layers, int layer,
    int max_blocks, float scale, int bf16)
{
    const int group = q_heads / kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_DIM) return -1;
    const int64_t token_stride = (int64_t)kv_heads * head_dim;
    const int64_t plane = (int64_t)block_size * token_stride;

    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            float qv[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], m[MAX_GROUP], l[MAX_GROUP];
            float k[MAX_DIM], v[MAX_DIM];
            for (int g = 0; g < group; g++) {
                load_row(q, ((int64_t)b * q_heads + h * group + g) * head_dim, head_dim, bf16, qv[g]);
                for (int d = 0; d < head_dim; d++) { qv[g][d] *= scale; acc[g][d] = 0.0f; }
                m[g] = -INFINITY;
                l[g] = 0.0f;
            }
            const int64_t len = lens[b];
            for (int64_t t = 0; t < len; t++) {
                const int64_t block = tables[(int64_t)b * max_blocks + t / block_size];
                const int64_t base = (block * num_layers + layer) * 2 * plane + (t % block_size) * token_stride
                                     + (int64_t)h * head_dim;
                load_row(pool, base, head_dim, bf16, k);
                load_row(pool, base + plane, head_dim, bf16, v);
                for (int g = 0; g < group; g++) {
                    float s = 0.0f;
                    for (int d = 0; d < head_dim; d++) s += qv[g][d] * k[d];
                    if (s > m[g]) {  /* rescale what was accumulated under the old maximum */
                        const float c = expf(m[g] - s);
                        l[g] *= c;
                        for (int d = 0; d < head_dim; d++) acc[g][d] *= c;
                        m[g] = s;
                    }
                    const float p = expf(s - m[g]);
                    l[g] += p;
                    for (int d = 0; d < head_dim; d++) acc[g][d] += p * v[d];
                }
            }
            for (int g = 0; g < group; g++) {
                const int64_t o = ((int64_t)b * q_heads + h * group + g) * head_dim;
                const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                for (int d = 0; d < head_dim; d++) {
                    const float x = acc[g][d] * inv;
                    if (bf16) ((uint16_t *)out)[o + d] = f32_to_bf16(x);
                    else ((float *)out)[o + d] = x;
                }
            }
        }
    }
    return 0;
}
