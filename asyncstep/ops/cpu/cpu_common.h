/*
 * Scalar helpers the library's sources share: bfloat16 <-> float32 (round
 * to nearest even, NaN kept quiet) and exp by Cephes' polynomial.
 */
#ifndef ASYNCSTEP_CPU_COMMON_H
#define ASYNCSTEP_CPU_COMMON_H
#include <stdint.h>

typedef uint16_t bf16_t;

/* always_inline: callers compiled with other optimisation options inline them too. */
static inline __attribute__((always_inline)) float bf16_to_f32(bf16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}

static inline __attribute__((always_inline)) bf16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

/* exp(x) for x <= 88 (0 below -87), Cephes' polynomial; branch-free, so loops
 * over it vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } c = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * c.f;
}

#endif
