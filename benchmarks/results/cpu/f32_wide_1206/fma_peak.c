#include <stdlib.h>
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
int main(int argc, char** argv){
  int threads = argc > 1 ? atoi(argv[1]) : 2;
  long iters=200000000; float res=0;
  double t0=omp_get_wtime();
  #pragma omp parallel num_threads(threads) reduction(+:res)
  { __m256 a[12]; for(int i=0;i<12;i++) a[i]=_mm256_set1_ps(i*0.001f);
    __m256 b=_mm256_set1_ps(0.9999f), c=_mm256_set1_ps(0.0001f);
    for(long i=0;i<iters;i++){ for(int j=0;j<12;j++) a[j]=_mm256_fmadd_ps(a[j],b,c);}
    float o[8]; __m256 s=a[0]; for(int j=1;j<12;j++) s=_mm256_add_ps(s,a[j]); _mm256_storeu_ps(o,s); res+=o[0];}
  double t=omp_get_wtime()-t0;
  printf("256-bit: %.1f GFLOP/s (%d threads) %f\n", 2.0*iters*12*8*threads/t/1e9, threads, res);
  t0=omp_get_wtime();
  #pragma omp parallel num_threads(threads) reduction(+:res)
  { __m512 a[12]; for(int i=0;i<12;i++) a[i]=_mm512_set1_ps(i*0.001f);
    __m512 b=_mm512_set1_ps(0.9999f), c=_mm512_set1_ps(0.0001f);
    for(long i=0;i<iters;i++){ for(int j=0;j<12;j++) a[j]=_mm512_fmadd_ps(a[j],b,c);}
    __m512 s=a[0]; for(int j=1;j<12;j++) s=_mm512_add_ps(s,a[j]); res+=_mm512_reduce_add_ps(s);}
  t=omp_get_wtime()-t0;
  printf("512-bit: %.1f GFLOP/s (%d threads) %f\n", 2.0*iters*12*16*threads/t/1e9, threads, res);
}
