#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
int main(){
  double t0=omp_get_wtime(); long iters=200000000; float res=0;
  #pragma omp parallel num_threads(2) reduction(+:res)
  { __m256 a[10]; for(int i=0;i<10;i++) a[i]=_mm256_set1_ps(i*0.001f);
    __m256 b=_mm256_set1_ps(0.9999f), c=_mm256_set1_ps(0.0001f);
    for(long i=0;i<iters;i++){ for(int j=0;j<10;j++) a[j]=_mm256_fmadd_ps(a[j],b,c);}
    float o[8]; __m256 s=a[0]; for(int j=1;j<10;j++) s=_mm256_add_ps(s,a[j]); _mm256_storeu_ps(o,s); res+=o[0];}
  double t=omp_get_wtime()-t0;
  printf("%.1f GFLOP/s (2 threads) %f\n", 2.0*iters*10*8*2/t/1e9, res);
}
