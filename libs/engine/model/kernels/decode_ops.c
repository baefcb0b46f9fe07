/* The small element-wise steps of a decode layer, fused, for a few rows of bfloat16:
 * what lies between the matmuls and the attention (fused.py calls them).
 *
 * A decode step of a small model over a few sequences spends most of its time not in
 * arithmetic but in launching ~25 tiny PyTorch ops per layer (an RMSNorm alone is
 * eight). Each function here replaces several of them with one call, and rounds to
 * bfloat16 exactly where the PyTorch modules do (llama.py), so the two paths give the
 * same values, bit for bit:
 *
 * - add_rms_norm: x += delta (rounded), h = w * bf16(x * rsqrt(mean(x^2) + eps)), the mean
 *   summed in PyTorch's own order;
 * - rope_kv_write: rotate the q and k heads of a fused qkv row (each product and the
 *   sum rounded, as x * cos + rotate_half(x) * sin in bfloat16 is), q to its own
 *   buffer, k and v straight into the paged pool (kv_pool.py's layout);
 * - silu_mul: bf16(bf16(silu(gate)) * up), its exponent a polynomial (numeric.h).
 *
 * The fused prefill (fused.py) runs the same functions over a step's hundreds of rows.
 * Rows are independent, so they are shared among the OpenMP team from PARALLEL_ROWS rows
 * on, each row computed exactly as alone; below that (a decode step's few rows of 576-1536
 * values) a thread's wake-up costs more than the work, and one thread runs them.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* The sums and the division below must round as PyTorch's do: none of the reassociation
 * or reciprocals the shared kernel flags allow (native.py). */
#if defined(__clang__)
#pragma clang fp reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math", "no-reciprocal-math")
#endif

#include "numeric.h"

#define PARALLEL_ROWS 32

/* The float32 sum PyTorch's CPU kernel computes for a contiguous row (cascade_sum in
 * ATen's SumKernel.cpp), in its order, so that the mean of squares, and so the norm,
 * is PyTorch's to the bit: `lanes` floats to a vector (fused.torch_lanes finds it: 8 on x86),
 * the vectors summed as rows of four into four accumulators with a cascade of levels,
 * the four added, then the tail scalars and the lanes one by one. No reassociation is
 * allowed here (the pragma at the top of the file). */
static float sum_as_torch(const float *restrict x, int n, int lanes) {
    float acc[4][4][16] = {{{0}}};  /* level, row of the four, lane */
    const int64_t vectors = n / lanes, size = vectors / 4;
    int64_t bits = 0;
    while (bits < 63 && ((int64_t)1 << bits) < size) bits++;  /* bit width of size - 1, at least 1 */
    const int64_t ceil_log2 = size <= 2 ? 1 : bits;
    const int64_t power = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4, step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++) acc[0][k][l] += x[(i * 4 + k) * lanes + l];
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.0f; }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += x[(i * 4 + k) * lanes + l];
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = size * 4; v < vectors; v++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += x[v * lanes + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; t++) total += x[t];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* x, delta, out: [rows, dim]; weight: [dim]. delta may be NULL (no residual add).
 * `lanes`: the float32 vector width of PyTorch's kernels on this CPU (sum_as_torch). */
int add_rms_norm(uint16_t *restrict x, const uint16_t *restrict delta, const uint16_t *restrict weight,
                 uint16_t *restrict out, int rows, int dim, float eps, int lanes) {
    if (dim > 8192 || lanes < 1 || lanes > 16) return -1;
    #pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        float row[8192], squares[8192];
        uint16_t *xr = x + (int64_t)r * dim;
        if (delta != NULL) {
            const uint16_t *dr = delta + (int64_t)r * dim;
            for (int i = 0; i < dim; i++) {
                const uint16_t s = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
                xr[i] = s;
                row[i] = bf16_to_f32(s);
            }
        } else {
            for (int i = 0; i < dim; i++) row[i] = bf16_to_f32(xr[i]);
        }
        for (int i = 0; i < dim; i++) squares[i] = row[i] * row[i];
        const float mean = sum_as_torch(squares, dim, lanes) / (float)dim;
        const float inv = 1.0f / sqrtf(mean + eps);
        uint16_t *o = out + (int64_t)r * dim;
        for (int i = 0; i < dim; i++) o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(row[i] * inv));
    }
    return 0;
}

/* qkv: [rows, (q_heads + 2 kv_heads) * head_dim], q heads then k heads then v heads.
 * cos, sin: [max_positions, head_dim] in bfloat16; q_out: [rows, q_heads, head_dim].
 * pool: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]; row r's K/V go to
 * block slot_blocks[r], position slot_offsets[r] of `layer`. */
void rope_kv_write(const uint16_t *restrict qkv, const uint16_t *restrict cos, const uint16_t *restrict sin,
                   const int64_t *restrict positions, uint16_t *restrict q_out, uint16_t *restrict pool,
                   const int64_t *restrict slot_blocks, const int64_t *restrict slot_offsets, int rows, int q_heads,
                   int kv_heads, int head_dim, int block_size, int num_layers, int layer) {
    const int half = head_dim / 2, width = (q_heads + 2 * kv_heads) * head_dim;
    const int64_t token_stride = (int64_t)kv_heads * head_dim;
    const int64_t plane = (int64_t)block_size * token_stride;
    const int64_t block_stride = (int64_t)num_layers * 2 * plane;
    #pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const uint16_t *src = qkv + (int64_t)r * width;
        const uint16_t *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        uint16_t *k_dst = pool + slot_blocks[r] * block_stride + (int64_t)layer * 2 * plane + slot_offsets[r] * token_stride;
        uint16_t *v_dst = k_dst + plane;
        for (int h = 0; h < q_heads + kv_heads; h++) {
            const uint16_t *x = src + (int64_t)h * head_dim;
            uint16_t *dst = h < q_heads ? q_out + ((int64_t)r * q_heads + h) * head_dim
                                        : k_dst + (int64_t)(h - q_heads) * head_dim;
            for (int d = 0; d < head_dim; d++) {
                /* rotate_half(x)[d] = -x[d + half] for d < half, x[d - half] after */
                const float rot = d < half ? -bf16_to_f32(x[d + half]) : bf16_to_f32(x[d - half]);
                const float a = round_bf16(bf16_to_f32(x[d]) * bf16_to_f32(c[d]));
                const float b = round_bf16(rot * bf16_to_f32(s[d]));
                dst[d] = f32_to_bf16(a + b);
            }
        }
        const uint16_t *v = src + (int64_t)(q_heads + kv_heads) * head_dim;
        for (int64_t i = 0; i < token_stride; i++) v_dst[i] = v[i];
    }
}

/* gate_up: [rows, 2 * inter], the gate then the up projection; out: [rows, inter]. */
void silu_mul(const uint16_t *restrict gate_up, uint16_t *restrict out, int rows, int inter) {
    if (inter > 16384) return;
    #pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        float e[16384];
        const uint16_t *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        uint16_t *o = out + (int64_t)r * inter;
        for (int i = 0; i < inter; i++) e[i] = exp_poly(-bf16_to_f32(g[i]));  /* two loops: each vectorises */
        for (int i = 0; i < inter; i++) {
            const float silu = round_bf16(bf16_to_f32(g[i]) / (1.0f + e[i]));
            o[i] = f32_to_bf16(silu * bf16_to_f32(u[i]));
        }
    }
}
