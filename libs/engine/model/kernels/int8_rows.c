/* One row times an int8 weight with a scale per output row, for a decode step of one
 * sequence on one thread: y[n] = bf16(sum_k x[k] * w[n][k] * scale[n]), bfloat16 x, y and
 * scale, int8 w ([N, K], row-major as Int8Linear keeps it), float32 sums.
 *
 * torch's weight-only int8 kernel (_weight_int8pack_mm) is bound by its arithmetic on one
 * thread: the 28 MB LM head of the default model took 3.8 ms on an AVX-512 Zen core, 7.5
 * GB/s. Here each weight row is one vectorised loop (sign-extend, convert, fused
 * multiply-add over the row converted once to float): 1.9 ms. No thread team: the caller
 * uses it only where torch itself runs on one thread. The sums are float32 like torch's
 * but in another order, so a result can differ from torch's by one bfloat16 rounding.
 */
#include <stdint.h>

#include "numeric.h"

#define MAX_K 16384

int int8_row(const uint16_t *restrict x, const int8_t *restrict w, const uint16_t *restrict scale,
             uint16_t *restrict y, int n, int k) {
    float xf[MAX_K];
    if (k > MAX_K) return -1;
    for (int i = 0; i < k; i++) xf[i] = bf16_to_f32(x[i]);
    for (int j = 0; j < n; j++) {
        const int8_t *wj = w + (int64_t)j * k;
        float acc = 0.0f;
        for (int i = 0; i < k; i++) acc += xf[i] * (float)wj[i];
        y[j] = f32_to_bf16(acc * bf16_to_f32(scale[j]));
    }
    return 0;
}
