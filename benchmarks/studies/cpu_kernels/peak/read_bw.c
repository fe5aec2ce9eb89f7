/* Memory read bandwidth of one core: 512 MiB summed in 64-byte vectors.
 *   cc -O2 -march=native read_bw.c -o /tmp/read_bw && /tmp/read_bw   (two at once: both cores) */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
int main(void) {
    long n = 512L << 20;
    float* a = aligned_alloc(64, n);
    for (long i = 0; i < n / 4; i++) a[i] = (float)i;
    double best = 1e9;
    __m512 s = _mm512_setzero_ps();
    for (int r = 0; r < 5; r++) {
        double t = now();
        for (long i = 0; i < n / 4; i += 16) s = _mm512_add_ps(s, _mm512_load_ps(a + i));
        t = now() - t;
        if (t < best) best = t;
    }
    printf("read %.1f GB/s (%f)\n", n / best / 1e9, _mm512_reduce_add_ps(s));
}
