/* Causal prefill attention straight from the paged KV pool, bfloat16, for one
 * sequence's chunk: n new query tokens at positions ctx - n .. ctx - 1, each
 * attending to every key up to its own position (the cached prefix and its own
 * causal part, all already written to the pool).
 *
 * Pool layout (see kv_pool.py): [num_blocks, num_layers, 2, block_size, kv_heads, head_dim].
 * q: [n, q_heads, head_dim] rows q_row_stride elements apart (a view of the fused
 * q/k projection); out: [n, q_heads, head_dim] contiguous.
 *
 * Blocked flash attention with an online softmax. Each kv head's keys and values are
 * first copied from their blocks into pair-interleaved panels (two consecutive
 * elements of a dot product side by side, what AVX512-BF16's vdpbf16ps multiplies),
 * once per call. Then each task, one kv head and BQ query tokens (its q_heads /
 * kv_heads query heads stacked as rows, so they share every key read), walks the keys
 * BK at a time up to its last token's position: scores = q k^T by register-tiled
 * vdpbf16ps (float32 sums, as torch's CPU flash kernel), the running max and sum per
 * row, the weights rounded to bfloat16 (as torch's does) and out += p v by vdpbf16ps.
 *
 * Returns 0, or -1 where it cannot run (no AVX512-BF16 at build time, a head size not
 * a multiple of 64): the caller then uses PyTorch's SDPA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "numeric.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

#define BQ 32 /* query tokens per task */
#define BK 64 /* keys per step of the online softmax */
#define QK_ROWS 8 /* rows of the q k^T register tile (x 2 vectors of 16 keys) */
#define PV_ROWS 6 /* rows of the p v register tile (x 4 vectors of 16 dims) */

/* Keys of one head as panels of 16 keys: [ctx_pad / 16][dim / 2][16][2] bf16, so that one
 * 64-byte load holds dims (2c, 2c+1) of 16 keys. Keys past ctx are zero. */
static void pack_keys(const uint16_t *pool, const int64_t *block_ids, int64_t ctx, int64_t ctx_pad, int dim,
                      int block_size, int64_t block_stride, int64_t token_stride, uint16_t *restrict dst) {
    for (int64_t t = 0; t < ctx_pad; t++) {
        uint16_t *panel = dst + (t / 16) * 16 * dim + (t % 16) * 2;
        if (t >= ctx) {
            for (int c = 0; c < dim / 2; c++) panel[c * 32] = panel[c * 32 + 1] = 0;
            continue;
        }
        const uint16_t *src = pool + block_ids[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int c = 0; c < dim / 2; c++) {
            panel[c * 32] = src[2 * c];
            panel[c * 32 + 1] = src[2 * c + 1];
        }
    }
}

/* Values of one head as pairs of keys: [ctx_pad / 2][dim][2] bf16, so that one 64-byte load
 * holds 16 dims of two consecutive keys. Keys past ctx are zero. */
static void pack_values(const uint16_t *pool, const int64_t *block_ids, int64_t ctx, int64_t ctx_pad, int dim,
                        int block_size, int64_t block_stride, int64_t token_stride, uint16_t *restrict dst) {
    for (int64_t t = 0; t < ctx_pad; t++) {
        uint16_t *pair = dst + (t / 2) * 2 * dim + (t % 2);
        if (t >= ctx) {
            for (int d = 0; d < dim; d++) pair[2 * d] = 0;
            continue;
        }
        const uint16_t *src = pool + block_ids[t / block_size] * block_stride + (t % block_size) * token_stride;
        for (int d = 0; d < dim; d++) pair[2 * d] = src[d];
    }
}

/* s[r][0:32] = q[r] . k for QK_ROWS rows and 32 keys (two panels). */
static inline void qk_tile(const uint16_t *q, int dim, const uint16_t *panels, float *s, int s_stride) {
    __m512 acc[QK_ROWS][2];
    for (int r = 0; r < QK_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t *p0 = panels, *p1 = panels + 16 * dim;
    for (int c = 0; c < dim / 2; c++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(p0 + c * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(p1 + c * 32);
        for (int r = 0; r < QK_ROWS; r++) {
            uint32_t pair;
            memcpy(&pair, q + r * dim + 2 * c, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, k1);
        }
    }
    for (int r = 0; r < QK_ROWS; r++) {
        _mm512_storeu_ps(s + r * s_stride, acc[r][0]);
        _mm512_storeu_ps(s + r * s_stride + 16, acc[r][1]);
    }
}

/* o[r][d0:d0+64] += p[r] . v[:, d0:d0+64] for `rows` (<= PV_ROWS) rows over `keys` keys (even). */
static inline void pv_tile(const uint16_t *p, int p_stride, const uint16_t *v, int dim, int d0, int keys, float *o,
                           int rows) {
    __m512 acc[PV_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_loadu_ps(o + r * dim + d0 + 16 * j);
    for (int kp = 0; kp < keys / 2; kp++) {
        const uint16_t *vp = v + (int64_t)kp * 2 * dim + 2 * d0;
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + 32);
        const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vp + 64);
        const __m512bh v3 = (__m512bh)_mm512_loadu_si512(vp + 96);
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            memcpy(&pair, p + r * p_stride + 2 * kp, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, v0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, v1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, v2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, v3);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(o + r * dim + d0 + 16 * j, acc[r][j]);
}

/* e^x of 16 lanes, x <= 0, as numeric.h's exp_poly; 0 below -40 (e^-40 is far under a
 * float sum's rounding, and the subnormal products it would make are slow). */
static inline __m512 exp16_nonpositive(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-40.0f), _CMP_GE_OQ);
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(2.1498022e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.2833665e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6413346e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503348e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022685e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, fi));
}

/* One row of a step's scores (BK of them, `valid` visible): scale, fold into the running
 * max m and sum l, write the weights as bfloat16 (0 past `valid`) and return the factor
 * the row's output so far must be multiplied by. */
static inline float softmax_row(float *sr, int valid, float scale, float *m, float *l, uint16_t *pr) {
    __m512 x[BK / 16];
    __m512 mx = _mm512_set1_ps(*m);
    for (int c = 0; c < BK / 16; c++) {
        const int left = valid - 16 * c;
        const __mmask16 k = left >= 16 ? 0xffff : (left <= 0 ? 0 : (__mmask16)((1u << left) - 1));
        x[c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), k, _mm512_loadu_ps(sr + 16 * c), _mm512_set1_ps(scale));
        mx = _mm512_max_ps(mx, x[c]);
    }
    const float row_max = _mm512_reduce_max_ps(mx);
    const __m512 vmax = _mm512_set1_ps(row_max);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < BK / 16; c++) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(x[c], vmax));  /* -inf lanes give 0 */
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(pr + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const float correction = *m == -INFINITY ? 0.0f : exp_poly(*m - row_max);
    *l = *l * correction + _mm512_reduce_add_ps(sum);
    *m = row_max;
    return correction;
}

static void attend_block(const uint16_t *q, int64_t q_row_stride, const uint16_t *keys, const uint16_t *values,
                         uint16_t *out, int64_t n, int64_t ctx, int h, int group, int q_heads, int dim, int64_t t0,
                         float scale, uint16_t *qt, float *s, uint16_t *p, float *o, float *m, float *l) {
    const int tokens = n - t0 < BQ ? (int)(n - t0) : BQ;
    const int rows = group * BQ;  /* row g * BQ + i: query head h * group + g, token t0 + i */
    for (int g = 0; g < group; g++)
        for (int i = 0; i < BQ; i++) {
            const int64_t t = t0 + (i < tokens ? i : tokens - 1);  /* padding rows repeat the last token */
            memcpy(qt + (g * BQ + i) * dim, q + t * q_row_stride + (int64_t)(h * group + g) * dim, 2 * dim);
        }
    for (int r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(o, 0, sizeof(float) * rows * dim);
    const int64_t first = ctx - n + t0;  /* position of the block's first token */
    const int64_t last = first + tokens - 1;
    for (int64_t k0 = 0; k0 <= last; k0 += BK) {
        const int nk = ctx - k0 < BK ? (int)(ctx - k0) : BK;  /* keys in this step */
        const int nk_even = (nk + 1) & ~1, tiles = (nk + 31) / 32;
        for (int r = 0; r < rows; r += QK_ROWS)
            for (int j = 0; j < tiles; j++)
                qk_tile(qt + r * dim, dim, keys + (k0 + 32 * j) * dim, s + r * BK + 32 * j, BK);
        const int masked = k0 + BK - 1 > first;  /* some key here lies after some row's position */
        for (int r = 0; r < rows; r++) {
            const int64_t pos = first + (r % BQ < tokens ? r % BQ : tokens - 1);
            const int valid = masked ? (pos - k0 + 1 < nk ? (int)(pos - k0 + 1) : nk) : nk;
            if (valid <= 0) {  /* every key of this step lies after the row's token */
                memset(p + r * BK, 0, sizeof(uint16_t) * BK);
                continue;
            }
            const float correction = softmax_row(s + r * BK, valid, scale, m + r, l + r, p + r * BK);
            if (correction != 1.0f)
                for (int d = 0; d < dim; d++) o[r * dim + d] *= correction;
        }
        for (int r = 0; r < rows; r += PV_ROWS) {
            const int nr = rows - r < PV_ROWS ? rows - r : PV_ROWS;
            for (int d0 = 0; d0 < dim; d0 += 64)
                pv_tile(p + r * BK, BK, values + k0 * dim, dim, d0, nk_even, o + r * dim, nr);
        }
    }
    for (int g = 0; g < group; g++)
        for (int i = 0; i < tokens; i++) {
            const int r = g * BQ + i;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            uint16_t *dst = out + ((t0 + i) * q_heads + h * group + g) * (int64_t)dim;
            for (int d = 0; d < dim; d++) dst[d] = f32_to_bf16(o[r * dim + d] * inv);
        }
}

int paged_prefill_attention(const void *q, int64_t q_row_stride, const void *pool, const int64_t *block_ids,
                            int64_t n, int64_t ctx, void *out, int q_heads, int kv_heads, int head_dim,
                            int block_size, int num_layers, int layer, float scale) {
    if (head_dim % 64 != 0 || q_heads % kv_heads != 0 || n < 1 || n > ctx) return -1;
    const int group = q_heads / kv_heads, dim = head_dim;
    const int64_t token_stride = (int64_t)kv_heads * dim;
    const int64_t plane = (int64_t)block_size * token_stride;
    const int64_t block_stride = (int64_t)num_layers * 2 * plane;
    const uint16_t *keys_pool = (const uint16_t *)pool + (int64_t)layer * 2 * plane;
    const uint16_t *values_pool = keys_pool + plane;
    const int64_t ctx_pad = (ctx + BK - 1) / BK * BK;
    uint16_t *panels = malloc(sizeof(uint16_t) * 2 * kv_heads * ctx_pad * dim);
    if (panels == NULL) return -2;
    uint16_t *keys = panels, *values = panels + kv_heads * ctx_pad * dim;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int h = 0; h < kv_heads; h++)
        for (int which = 0; which < 2; which++) {
            if (which == 0)
                pack_keys(keys_pool + h * dim, block_ids, ctx, ctx_pad, dim, block_size, block_stride, token_stride,
                          keys + h * ctx_pad * dim);
            else
                pack_values(values_pool + h * dim, block_ids, ctx, ctx_pad, dim, block_size, block_stride,
                            token_stride, values + h * ctx_pad * dim);
        }
    const int64_t q_blocks = (n + BQ - 1) / BQ;
    /* each thread's scratch: its tile of q, scores, weights, output, max and sum */
    const int rows = group * BQ;
    const size_t scratch = sizeof(uint16_t) * rows * dim + sizeof(float) * rows * BK + sizeof(uint16_t) * rows * BK +
                           sizeof(float) * rows * dim + sizeof(float) * rows * 2;
    const int threads = omp_get_max_threads();
    char *arena = malloc(scratch * threads);
    if (arena == NULL) {
        free(panels);
        return -2;
    }
    #pragma omp parallel num_threads(threads)
    {
        char *mine = arena + scratch * omp_get_thread_num();
        uint16_t *qt = (uint16_t *)mine;
        float *s = (float *)(qt + rows * dim);
        uint16_t *p = (uint16_t *)(s + rows * BK);
        float *o = (float *)(p + rows * BK);
        float *m = o + rows * dim;
        /* later query blocks see more keys: hand them out first, dynamically */
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < q_blocks; b++)
            for (int h = 0; h < kv_heads; h++)
                attend_block((const uint16_t *)q, q_row_stride, keys + h * ctx_pad * dim, values + h * ctx_pad * dim,
                             (uint16_t *)out, n, ctx, h, group, q_heads, dim, (q_blocks - 1 - b) * BQ, scale, qt, s,
                             p, o, m, m + rows);
    }
    free(arena);
    free(panels);
    return 0;
}

#else

int paged_prefill_attention(const void *q, int64_t q_row_stride, const void *pool, const int64_t *block_ids,
                            int64_t n, int64_t ctx, void *out, int q_heads, int kv_heads, int head_dim,
                            int block_size, int num_layers, int layer, float scale) {
    return -1;  /* built without AVX512-BF16: PyTorch's SDPA does it */
}

#endif
