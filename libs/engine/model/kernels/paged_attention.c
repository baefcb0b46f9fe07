/* Decode attention straight from the paged KV pool: one query token per sequence,
 * keys and values read in place from their blocks (no gather).
 *
 * Pool layout (see kv_pool.py): [num_blocks, num_layers, 2, block_size, kv_heads, head_dim].
 * q, out: [batch, q_heads, head_dim]. Tables: [batch, max_blocks] block ids; lens: [batch].
 * Each (sequence, kv head) pair is one task; its q_heads / kv_heads query heads share
 * every key and value read. float32 or bfloat16 storage, float32 arithmetic.
 *
 * Two passes over the keys and values instead of an online softmax: the scores of
 * every position first (one dot product per query head and key row), then one
 * exponent pass over a contiguous row of scores, then the weighted sum of the
 * values. Every inner loop is branch-free over contiguous floats, so the compiler
 * vectorises all of them; the exponent is a polynomial for that reason (libm's
 * expf is a call per element). Each block's rows are prefetched while the block
 * before is computed on (prefetch_rows says why). Threads only when there is
 * enough work to pay for waking them: one short sequence runs on the calling thread.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "numeric.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define PARALLEL_MIN_ROWS 4096 /* key rows x kv heads below which one thread does it all */

static inline void load_row(const void *base, int64_t index, int dim, int bf16, float *restrict dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)base + index, sizeof(float) * dim);
    }
}

/* e^x for x <= 0 (scores minus their maximum). Below -40 it is 0: e^-40 (4e-18) is
 * far under a float32 sum's rounding, and the tiny weights it would give make subnormal
 * products in the value sum, each ~100x slower than a normal one on x86 (real
 * attention, with most of its weight on a few positions, has thousands of them a step). */
static inline float exp_nonpositive(float x) { return x < -40.0f ? 0.0f : exp_poly(x); }

/* Ask for one block's rows of this head ahead of use: blocks lie scattered across the
 * pool, and a read that waits for each block's first miss runs at a fraction of the
 * memory's bandwidth (~4 of ~20 GB/s here, 30 layers' K/V being far larger than cache). */
static inline void prefetch_rows(const void *base, int64_t index, int rows, int64_t token_stride, int row_bytes,
                                 int itemsize) {
    const char *p = (const char *)base + index * itemsize;
    for (int i = 0; i < rows; i++)
        for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + i * token_stride * itemsize + off, 0, 0);
}

static void attend(const void *q, const void *pool, const int64_t *block_ids, int64_t len, void *out, int b, int h,
                   int q_heads, int group, int head_dim, int block_size, int64_t block_stride, int64_t plane,
                   int64_t token_stride, float scale, int bf16, float *restrict scores) {
    float qv[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];
    for (int g = 0; g < group; g++) {
        load_row(q, ((int64_t)b * q_heads + h * group + g) * head_dim, head_dim, bf16, qv[g]);
        for (int d = 0; d < head_dim; d++) { qv[g][d] *= scale; acc[g][d] = 0.0f; }
    }
    const int64_t head = (int64_t)h * head_dim;
    const int itemsize = bf16 ? 2 : 4, row_bytes = head_dim * itemsize;
    /* pass 1: scores[g * len + t] = q_g . k_t */
    if (len > 0) prefetch_rows(pool, block_ids[0] * block_stride + head, block_size, token_stride, row_bytes, itemsize);
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = block_ids[start / block_size] * block_stride + head;
        const int n = len - start < block_size ? (int)(len - start) : block_size;
        if (start + block_size < len)
            prefetch_rows(pool, block_ids[start / block_size + 1] * block_stride + head, block_size, token_stride,
                          row_bytes, itemsize);
        for (int i = 0; i < n; i++) {
            load_row(pool, base + i * token_stride, head_dim, bf16, row);
            for (int g = 0; g < group; g++) {
                float s = 0.0f;
                for (int d = 0; d < head_dim; d++) s += qv[g][d] * row[d];
                scores[g * len + start + i] = s;
            }
        }
    }
    /* pass 2: softmax weights, unnormalised; their sums normalise at the end */
    float sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *restrict s = scores + g * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
        float l = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            l += s[t];
        }
        sum[g] = l;
    }
    /* pass 3: acc_g += p_gt v_t */
    if (len > 0)
        prefetch_rows(pool, block_ids[0] * block_stride + plane + head, block_size, token_stride, row_bytes, itemsize);
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = block_ids[start / block_size] * block_stride + plane + head;
        const int n = len - start < block_size ? (int)(len - start) : block_size;
        if (start + block_size < len)
            prefetch_rows(pool, block_ids[start / block_size + 1] * block_stride + plane + head, block_size,
                          token_stride, row_bytes, itemsize);
        for (int i = 0; i < n; i++) {
            load_row(pool, base + i * token_stride, head_dim, bf16, row);
            for (int g = 0; g < group; g++) {
                const float p = scores[g * len + start + i];
                for (int d = 0; d < head_dim; d++) acc[g][d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const int64_t o = ((int64_t)b * q_heads + h * group + g) * head_dim;
        const float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
        for (int d = 0; d < head_dim; d++) {
            const float x = acc[g][d] * inv;
            if (bf16) ((uint16_t *)out)[o + d] = f32_to_bf16(x);
            else ((float *)out)[o + d] = x;
        }
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
    const int64_t block_stride = (int64_t)num_layers * 2 * plane;
    const int64_t layer_offset = (int64_t)layer * 2 * plane;
    int64_t longest = 0, rows = 0;
    for (int b = 0; b < batch; b++) {
        longest = lens[b] > longest ? lens[b] : longest;
        rows += lens[b];
    }
    float *scores = malloc(sizeof(float) * (size_t)(longest > 0 ? longest : 1) * group * batch * kv_heads);
    if (scores == NULL) return -2;
    const int parallel = rows * kv_heads >= PARALLEL_MIN_ROWS;
    /* element offsets: block id * block_stride reaches a block, layer_pool its layer's K plane */
    const void *layer_pool = (const char *)pool + layer_offset * (bf16 ? 2 : 4);

    #pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            float *mine = scores + ((int64_t)b * kv_heads + h) * group * longest;
            attend(q, layer_pool, tables + (int64_t)b * max_blocks, lens[b], out, b, h, q_heads, group, head_dim,
                   block_size, block_stride, plane, token_stride, scale, bf16, mine);
        }
    }
    free(scores);
    return 0;
}
