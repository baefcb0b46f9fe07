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
 * once per call. Each task is one kv head and BQ query tokens, its rows token-major
 * (the q_heads / kv_heads query heads of a token side by side, so a tile's rows sit at
 * one or two positions). A tile of QK_ROWS rows walks the keys BK at a time up to its
 * last row's position, its output and running max and sums kept hot in L1 while the
 * keys stream from L2: scores = q k^T left in registers (vdpbf16ps, float32 sums, as
 * torch's CPU flash kernel), the softmax folded in from them, the weights rounded to
 * bfloat16 (as torch's) and out += p v by vdpbf16ps.
 *
 * The softmax works in base 2 and moves a row's running max lazily (LAZY_LOG2): most
 * steps then need no row reduction and no rescaling of the row's output, and each row
 * keeps 16 partial sums, added once at the end.
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
#define QK_ROWS 6 /* rows of a tile: q k^T in 6 x 4 vectors of 16 keys, p v in 6 x 4 of 16 dims */

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

/* Scores of QK_ROWS rows against BK keys (four panels of 16), left in registers. */
static inline void qk_tile(const uint16_t *q, int dim, const uint16_t *panels, __m512 acc[QK_ROWS][4]) {
    for (int r = 0; r < QK_ROWS; r++) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_ps();
    const uint16_t *p0 = panels, *p1 = panels + 16 * dim, *p2 = panels + 32 * dim, *p3 = panels + 48 * dim;
    for (int c = 0; c < dim / 2; c++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(p0 + c * 32);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(p1 + c * 32);
        const __m512bh k2 = (__m512bh)_mm512_loadu_si512(p2 + c * 32);
        const __m512bh k3 = (__m512bh)_mm512_loadu_si512(p3 + c * 32);
        for (int r = 0; r < QK_ROWS; r++) {
            uint32_t pair;
            memcpy(&pair, q + r * dim + 2 * c, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, k3);
        }
    }
}

/* o[r][d0:d0+64] += p[r] . v[:, d0:d0+64] for `rows` (<= QK_ROWS) rows over `keys` keys (even). */
static inline void pv_tile(const uint16_t *p, int p_stride, const uint16_t *v, int dim, int d0, int keys, float *o,
                           int rows) {
    __m512 acc[QK_ROWS][4];
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

/* 2^x of 16 lanes, x <= LAZY_LOG2: an integer power and 2^f, f in [0, 1), by a degree-4
 * polynomial (relative error 5e-6, 400x under the bfloat16 rounding of the weights it
 * makes). x is clamped at -126, where 2^x is still a normal float: a weight that small
 * is far under the row sum's rounding, and vdpbf16ps flushes the subnormal products it
 * makes. */
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 fi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, fi);
    __m512 p = _mm512_set1_ps(1.3534167e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2011464e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144275e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300383e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, fi);
}

/* The running max moves only when a score passes it by more than this (log2 units): the
 * weights then stay under 2^LAZY_LOG2, and the rows' outputs are rescaled rarely. */
#define LAZY_LOG2 8.0f

/* One row's scores of a step (x, log2 units, -inf where masked): fold into the running
 * max m (moved lazily) and the row's 16 partial sums l, rescale the row's output o when
 * m moves, and write the weights as bfloat16. */
static inline void softmax_row(__m512 x[4], const __mmask16 valid[4], float *m, float *l, float *o, int dim,
                               uint16_t *pr) {
    const __m512 limit = _mm512_set1_ps(*m + LAZY_LOG2);
    const __mmask16 over = _mm512_cmp_ps_mask(x[0], limit, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x[1], limit, _CMP_GT_OQ) |
                           _mm512_cmp_ps_mask(x[2], limit, _CMP_GT_OQ) | _mm512_cmp_ps_mask(x[3], limit, _CMP_GT_OQ);
    if (over) {  /* the first step, or a score far above the max so far */
        const float row_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
        if (*m != -INFINITY) {
            const __m512 correction = exp2_16(_mm512_set1_ps(*m - row_max));
            _mm512_storeu_ps(l, _mm512_mul_ps(_mm512_loadu_ps(l), correction));
            for (int d = 0; d < dim; d += 16)
                _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), correction));
        }
        *m = row_max;
    }
    const __m512 vmax = _mm512_set1_ps(*m);
    __m512 sum = _mm512_loadu_ps(l);
    for (int c = 0; c < 4; c++) {
        const __m512 e = _mm512_maskz_mov_ps(valid[c], exp2_16(_mm512_sub_ps(x[c], vmax)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(pr + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
    }
    _mm512_storeu_ps(l, sum);
}

static void attend_block(const uint16_t *q, int64_t q_row_stride, const uint16_t *keys, const uint16_t *values,
                         uint16_t *out, int64_t n, int64_t ctx, int h, int group, int q_heads, int dim, int64_t t0,
                         float scale, uint16_t *qt, uint16_t *p, float *o, float *m, float *l) {
    const int tokens = n - t0 < BQ ? (int)(n - t0) : BQ;
    const int rows = group * tokens;  /* row i * group + g: token t0 + i, query head h * group + g */
    for (int i = 0; i < tokens; i++)
        memcpy(qt + i * group * dim, q + (t0 + i) * q_row_stride + (int64_t)h * group * dim,
               sizeof(uint16_t) * group * dim);
    for (int r = rows; r % QK_ROWS != 0; r++)  /* a last tile's padding rows repeat the last row */
        memcpy(qt + r * dim, qt + (rows - 1) * dim, sizeof(uint16_t) * dim);
    const __m512 scale_log2 = _mm512_set1_ps(scale * 1.44269504088896341f);
    const int64_t first = ctx - n + t0;  /* position of the block's first token */
    for (int r0 = 0; r0 < rows; r0 += QK_ROWS) {
        const int nr = rows - r0 < QK_ROWS ? rows - r0 : QK_ROWS;
        int64_t pos[QK_ROWS], lo = INT64_MAX, hi = -1;
        for (int i = 0; i < QK_ROWS; i++) {
            const int r = r0 + (i < nr ? i : nr - 1);
            pos[i] = first + r / group;
            lo = pos[i] < lo ? pos[i] : lo;
            hi = pos[i] > hi ? pos[i] : hi;
            m[i] = -INFINITY;
        }
        memset(l, 0, sizeof(float) * QK_ROWS * 16);
        memset(o, 0, sizeof(float) * QK_ROWS * dim);
        for (int64_t k0 = 0; k0 <= hi; k0 += BK) {
            const int nk = ctx - k0 < BK ? (int)(ctx - k0) : BK;  /* keys in this step */
            const int nk_even = (nk + 1) & ~1;
            const int masked = k0 + BK - 1 > lo;  /* some key here lies after some row's position */
            __m512 acc[QK_ROWS][4];
            qk_tile(qt + r0 * dim, dim, keys + k0 * dim, acc);
            for (int i = 0; i < QK_ROWS; i++) {
                const int valid = masked ? (pos[i] - k0 + 1 < nk ? (int)(pos[i] - k0 + 1) : nk) : nk;
                if (valid <= 0) {  /* every key of this step lies after the row's token */
                    memset(p + i * BK, 0, sizeof(uint16_t) * BK);
                    continue;
                }
                __m512 x[4];
                __mmask16 k[4];
                for (int c = 0; c < 4; c++) {
                    const int left = valid - 16 * c;
                    k[c] = left >= 16 ? 0xffff : (left <= 0 ? 0 : (__mmask16)((1u << left) - 1));
                    x[c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), k[c], acc[i][c], scale_log2);
                }
                softmax_row(x, k, m + i, l + i * 16, o + i * dim, dim, p + i * BK);
            }
            for (int d0 = 0; d0 < dim; d0 += 64)
                pv_tile(p, BK, values + k0 * dim, dim, d0, nk_even, o, QK_ROWS);
        }
        for (int i = 0; i < nr; i++) {
            const int r = r0 + i, g = r % group, t = r / group;
            const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(l + i * 16));
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            uint16_t *dst = out + ((t0 + t) * q_heads + h * group + g) * (int64_t)dim;
            for (int d = 0; d < dim; d++) dst[d] = f32_to_bf16(o[i * dim + d] * inv);
        }
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
    /* each thread's scratch: its task's q rows (whole tiles), and one tile's weights,
     * output, running max and partial sums */
    const int rows = (group * BQ + QK_ROWS - 1) / QK_ROWS * QK_ROWS;
    const size_t scratch = sizeof(uint16_t) * rows * dim + sizeof(uint16_t) * QK_ROWS * BK +
                           sizeof(float) * QK_ROWS * dim + sizeof(float) * QK_ROWS * 17;
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
        uint16_t *p = qt + rows * dim;
        float *o = (float *)(p + QK_ROWS * BK);
        float *m = o + QK_ROWS * dim;
        /* later query blocks see more keys: hand them out first, dynamically */
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < q_blocks; b++)
            for (int h = 0; h < kv_heads; h++)
                attend_block((const uint16_t *)q, q_row_stride, keys + h * ctx_pad * dim, values + h * ctx_pad * dim,
                             (uint16_t *)out, n, ctx, h, group, q_heads, dim, (q_blocks - 1 - b) * BQ, scale, qt, p,
                             o, m, m + QK_ROWS);
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
