/* vpdpbusd (zmm) a second on one core: 12 independent accumulator chains.
 *   cc -O2 -march=native vnni_peak.c -o /tmp/vnni_peak && /tmp/vnni_peak */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define D(a) a = _mm512_dpbusd_epi32(a, w, x);
int main(int argc, char** argv) {
    (void)argv;
    __m512i w = _mm512_set1_epi8((char)argc), x = _mm512_set1_epi8(5);
    __m512i a0 = w, a1 = x, a2 = w, a3 = x, a4 = w, a5 = x, a6 = w, a7 = x, a8 = w, a9 = x,
            a10 = w, a11 = x;
    long n = 400000000;
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
        double t = now();
        for (long i = 0; i < n / 12; i++) {
            D(a0) D(a1) D(a2) D(a3) D(a4) D(a5) D(a6) D(a7) D(a8) D(a9) D(a10) D(a11)
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),
                             "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        }
        t = now() - t;
        if (t < best) best = t;
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
    printf("vpdpbusd zmm: %.3f G/s -> %.1f G int8 multiply-adds/s, one core (%d)\n", n / best / 1e9,
           64 * n / best / 1e9, _mm512_reduce_add_epi32(s));
}
