/*
 * Eight float32 accumulators of 8 lanes each summed by one network, shared
 * by the matmuls (cpu_dense.c, cpu_dense_f32.c, cpu_moe.c): (l[i] + l[i + 4])
 * for i < 4, then (s0 + s2) + (s1 + s3), whichever of the eight slots an
 * output holds: halves of 128 bits, then of 64, then pairs, every add's
 * operands shuffles (which the library's -fassociative-math cannot
 * regroup). For builds with AVX (include <immintrin.h> first).
 */
#ifndef ASYNCSTEP_CPU_SUM8_H
#define ASYNCSTEP_CPU_SUM8_H

/* out[p] = the sum of v[p]'s lanes. */
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

#endif
