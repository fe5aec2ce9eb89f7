/*
 * Helpers the library's sources share: bfloat16 <-> float32 (round to
 * nearest even, NaN kept quiet), exp by Cephes' polynomial and, in builds
 * with AVX2 (-march=native, ASYNCSTEP_CPU_KERNELS_ISA=avx2; every source is
 * compiled with the same flags), sum8: the dense matmuls' one summing tree,
 * and with AVX-512 the float32 matmuls' two-outputs-a-vector moves.
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

#if defined(__AVX2__)
#include <immintrin.h>

/* Eight accumulators' lanes summed by one network (halves of 128 bits, then
 * of 64, then pairs: every add's operands are shuffles, which the library's
 * -fassociative-math cannot regroup): (l[i] + l[i + 4]) for i < 4, then
 * (s0 + s2) + (s1 + s3), whichever of the eight slots an output holds.
 * out[p] = the sum of v[p]'s lanes. Used by cpu_dense.c's vector builds and
 * cpu_dense_f32.c's (whose plain C build sums in the same order). */
static inline __attribute__((always_inline)) void sum8(const __m256 v[8], float out[8]) {
    __m256 s[4], u[2];
    for (int j = 0; j < 4; j++)
        s[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++) {
        const __m256d a = _mm256_castps_pd(s[2 * j]), b = _mm256_castps_pd(s[2 * j + 1]);
        u[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88),
                                   _mm256_shuffle_ps(u[0], u[1], 0xDD));
    /* lane m holds output 2m, lane 4 + m output 2m + 1 */
    const __m256i where = _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0);
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(w, where));
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
/* Two 8-lane float32 accumulators in one 512-bit vector (the float32
 * matmuls' AVX-512 tiles): the low half one output's, the high half
 * another's, so each lane takes the products the 8-lane order gives it.
 * AVX512F alone: the halves move as 4 doubles, their bits unchanged. */
static inline __attribute__((always_inline)) __m512 wide_broadcast(__m256 v) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)));
}
static inline __attribute__((always_inline)) __m512 wide_pair(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
static inline __attribute__((always_inline)) __m256 wide_high(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* A wide tile's outputs: acc[p * nw + i] holds rows 2p (low half) and
 * 2p + 1 (high half) of x against row i of W; out[e * nw + i] = the sum of
 * row e's 8 lanes by sum8, for the first `rows` rows (at most 8, nw at most
 * 6: 48 outputs; a high half past `rows` is dropped). */
#define WIDE_MAX_OUTPUTS 48
static inline __attribute__((always_inline)) void wide_sums(const __m512* acc, const int rows,
                                                            const int nw, float* out) {
    __m256 lanes[WIDE_MAX_OUTPUTS];
    float flat[WIDE_MAX_OUTPUTS];
    const int used = rows * nw, groups = (used + 7) / 8;
    for (int p = 0; 2 * p < rows; p++)
        for (int i = 0; i < nw; i++) {
            lanes[2 * p * nw + i] = _mm512_castps512_ps256(acc[p * nw + i]);
            if (2 * p + 1 < rows) lanes[(2 * p + 1) * nw + i] = wide_high(acc[p * nw + i]);
        }
    for (int j = used; j < groups * 8; j++) lanes[j] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) sum8(lanes + 8 * g, flat + 8 * g);
    for (int j = 0; j < used; j++) out[j] = flat[j];
}
#endif
#endif

#endif
