/* Up to 8 rows times an int8 weight with a scale per output row, on one thread:
 * y[r][n] = bf16(sum_k x[r][k] * w[n][k] * scale[n]), bfloat16 x, y and scale, int8 w
 * ([N, K], row-major as Int8Linear keeps it), float32 sums.
 *
 * torch's weight-only int8 kernel (_weight_int8pack_mm) is bound by its arithmetic on one
 * thread: the 28 MB LM head of the default model took 3.6 ms for one row on an AVX-512 Zen
 * core and 11.1 ms for eight. Here each weight row is read once for all the rows
 * (sign-extend, convert, a fused multiply-add per row over the rows converted once to
 * float): 1.8 ms for one row, 2.4 for two, 3.5 for four, 7.0 for eight
 * (bench/decode_rows.py --kernel). int8_rows runs on one thread: the caller uses it only
 * where torch itself runs on one thread. The sums are float32 like torch's but in another order, so a
 * result can differ from torch's by one bfloat16 rounding; a row's result does not depend
 * on the rows beside it (its sum is the same loop whatever their number).
 *
 * int8_rows_f32 gives the same sums unrounded, in float32: the LM head's logits. Rounded to
 * bfloat16 (an ulp of 0.125 at 16-32) two close logits often become equal, and greedy
 * decoding then takes the lower token id rather than the model's choice. It runs wherever
 * torch runs on several threads too, its weight rows shared among them (an OpenMP team).
 */
#include <stdint.h>
#include <stdlib.h>

#include "numeric.h"

#define MAX_K 16384
#define MAX_ROWS 8

/* Output rows [j0, j1) of y ([m, n]). m and f32 are constants where they are called (the
 * switches below), so each case gets its own loop. */
static inline __attribute__((always_inline)) void rows(const float *restrict xf, const int8_t *restrict w,
                                                       const uint16_t *restrict scale, void *restrict y,
                                                       int j0, int j1, int n, int k, const int m, const int f32) {
    for (int j = j0; j < j1; j++) {
        const int8_t *wj = w + (int64_t)j * k;
        float acc[MAX_ROWS] = {0};
        for (int i = 0; i < k; i++) {
            const float wf = (float)wj[i];
            for (int r = 0; r < m; r++) acc[r] += xf[r * k + i] * wf;
        }
        const float s = bf16_to_f32(scale[j]);
        for (int r = 0; r < m; r++) {
            if (f32) ((float *)y)[(int64_t)r * n + j] = acc[r] * s;
            else ((uint16_t *)y)[(int64_t)r * n + j] = f32_to_bf16(acc[r] * s);
        }
    }
}

static void some_rows(const float *restrict xf, const int8_t *restrict w, const uint16_t *restrict scale,
                      void *restrict y, int j0, int j1, int n, int k, int m, int f32) {
    switch (m * 2 + f32) {
        case 2: rows(xf, w, scale, y, j0, j1, n, k, 1, 0); break;
        case 3: rows(xf, w, scale, y, j0, j1, n, k, 1, 1); break;
        case 4: rows(xf, w, scale, y, j0, j1, n, k, 2, 0); break;
        case 5: rows(xf, w, scale, y, j0, j1, n, k, 2, 1); break;
        case 6: rows(xf, w, scale, y, j0, j1, n, k, 3, 0); break;
        case 7: rows(xf, w, scale, y, j0, j1, n, k, 3, 1); break;
        case 8: rows(xf, w, scale, y, j0, j1, n, k, 4, 0); break;
        case 9: rows(xf, w, scale, y, j0, j1, n, k, 4, 1); break;
        case 10: rows(xf, w, scale, y, j0, j1, n, k, 5, 0); break;
        case 11: rows(xf, w, scale, y, j0, j1, n, k, 5, 1); break;
        case 12: rows(xf, w, scale, y, j0, j1, n, k, 6, 0); break;
        case 13: rows(xf, w, scale, y, j0, j1, n, k, 6, 1); break;
        case 14: rows(xf, w, scale, y, j0, j1, n, k, 7, 0); break;
        case 15: rows(xf, w, scale, y, j0, j1, n, k, 7, 1); break;
        case 16: rows(xf, w, scale, y, j0, j1, n, k, 8, 0); break;
        default: rows(xf, w, scale, y, j0, j1, n, k, 8, 1); break;
    }
}

#define SPAN 256 /* output rows per task when threads share the weight */

static int run(const uint16_t *restrict x, const int8_t *restrict w, const uint16_t *restrict scale,
               void *restrict y, int m, int n, int k, int f32, int threads) {
    if (k > MAX_K || m < 1 || m > MAX_ROWS) return -1;
    float *xf = malloc(sizeof(float) * (size_t)m * k);
    if (xf == NULL) return -1;
    for (int i = 0; i < m * k; i++) xf[i] = bf16_to_f32(x[i]);
    if (threads > 1) {
        const int spans = (n + SPAN - 1) / SPAN;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int t = 0; t < spans; t++) {
            const int j1 = (t + 1) * SPAN < n ? (t + 1) * SPAN : n;
            some_rows(xf, w, scale, y, t * SPAN, j1, n, k, m, f32);
        }
    } else {
        some_rows(xf, w, scale, y, 0, n, n, k, m, f32);
    }
    free(xf);
    return 0;
}

/* y: [m, n] bfloat16; one thread. */
int int8_rows(const uint16_t *restrict x, const int8_t *restrict w, const uint16_t *restrict scale,
              uint16_t *restrict y, int m, int n, int k) {
    return run(x, w, scale, y, m, n, k, 0, 1);
}

/* y: [m, n] float32, the weight's rows shared among `threads` threads (an LM head's logits
 * wherever torch runs on several). */
int int8_rows_f32(const uint16_t *restrict x, const int8_t *restrict w, const uint16_t *restrict scale,
                  float *restrict y, int m, int n, int k, int threads) {
    return run(x, w, scale, y, m, n, k, 1, threads);
}
