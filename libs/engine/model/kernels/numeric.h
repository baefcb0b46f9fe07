/* What every kernel here shares: bfloat16 <-> float32 as PyTorch converts, and an
 * exponent whose loops vectorise. Included by the kernels' .c files (native.py
 * recompiles them when this changes). */
#ifndef KVSERVE_NUMERIC_H
#define KVSERVE_NUMERIC_H

#include <math.h>
#include <stdint.h>

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

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* e^x, relative error ~2e-7, as a polynomial so that the loop around it vectorises
 * (libm's expf is a call per element): 2^(x log2 e) split into an integer power (the
 * exponent bits) and 2^f, f in [0, 1), by a degree-6 polynomial. x is clamped to
 * [-87, 88], where e^x stays a normal float (ternaries, not fminf/fmaxf: those keep
 * the loop scalar). */
static inline float exp_poly(float x) {
    const float t = (x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x)) * 1.44269504088896341f;
    const float fi = floorf(t);
    const float f = t - fi;
    float p = 2.1498022e-4f;
    p = p * f + 1.2833665e-3f;
    p = p * f + 9.6413346e-3f;
    p = p * f + 5.5503348e-2f;
    p = p * f + 2.4022685e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)fi + 127) << 23;
    return p * scale.f;
}

#endif
