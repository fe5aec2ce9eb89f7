#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include "cpu_common.h"
#define K 512
#define KEEP(v) __asm__("" : "+v"(v))
/* the 8x6 wide tile's loop, W rows (6) and x rows (8) in L1 */
static void tile(const float* const* x, const float* const* w, float* out, int sums) {
    __m512 acc[24];
    for (int j = 0; j < 24; j++) acc[j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m512 wv[6];
        for (int i = 0; i < 6; i++) wv[i] = wide_broadcast(_mm256_loadu_ps(w[i] + k));
        for (int i = 0; i < 6; i++) KEEP(wv[i]);
        for (int p = 0; p < 4; p++) {
            __m512 xv = wide_pair(_mm256_loadu_ps(x[2*p] + k), _mm256_loadu_ps(x[2*p+1] + k));
            for (int i = 0; i < 6; i++) acc[p*6+i] = _mm512_fmadd_ps(wv[i], xv, acc[p*6+i]);
        }
    }
    if (sums) wide_sums(acc, 8, 6, out);
    else for (int j = 0; j < 24; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}
int main(int argc, char** argv) {
    int nw_rows = atoi(argv[1]); /* rows of W cycled through (L1: 6, L2: 96) */
    int sums = atoi(argv[2]);
    float* W = aligned_alloc(64, (size_t)nw_rows * K * 4);
    float* X = aligned_alloc(64, 8 * K * 4);
    for (long i = 0; i < (long)nw_rows * K; i++) W[i] = 0.001f * (i % 7);
    for (long i = 0; i < 8 * K; i++) X[i] = 0.002f * (i % 5);
    const float* x[8]; for (int e = 0; e < 8; e++) x[e] = X + e * K;
    float out[48]; double best = 1e9; float chk = 0;
    long iters = 200000;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = omp_get_wtime();
        for (long it = 0; it < iters; it++) {
            int r = (int)((it * 6) % nw_rows);
            const float* w[6]; for (int i = 0; i < 6; i++) w[i] = W + (long)((r + i) % nw_rows) * K;
            tile(x, w, out, sums);
            chk += out[it % 48];
        }
        double t = omp_get_wtime() - t0; if (t < best) best = t;
    }
    printf("W rows %d sums %d: %.1f GFLOP/s one thread (%f)\n", nw_rows, sums, 2.0 * 48 * K * iters / best / 1e9, chk);
}
