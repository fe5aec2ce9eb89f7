#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
int main(int argc, char** argv){
  long mb = atol(argv[1]); long n = mb<<18; float* a = aligned_alloc(64, n*4); for(long i=0;i<n;i++) a[i]=1.0f;
  double best = 0; float res = 0;
  for (int rep=0; rep<8; rep++){
  double t0=omp_get_wtime();
  #pragma omp parallel num_threads(2) reduction(+:res)
  { __m256 s0=_mm256_setzero_ps(),s1=s0,s2=s0,s3=s0;
    #pragma omp for schedule(static)
    for(long i=0;i<n;i+=32){ s0=_mm256_add_ps(s0,_mm256_load_ps(a+i)); s1=_mm256_add_ps(s1,_mm256_load_ps(a+i+8)); s2=_mm256_add_ps(s2,_mm256_load_ps(a+i+16)); s3=_mm256_add_ps(s3,_mm256_load_ps(a+i+24));}
    float o[8]; _mm256_storeu_ps(o,_mm256_add_ps(_mm256_add_ps(s0,s1),_mm256_add_ps(s2,s3))); res+=o[0];}
  double t=omp_get_wtime()-t0; if (n*4/t/1e9 > best) best = n*4/t/1e9;}
  printf("%ld MB: best read %.1f GB/s %f\n", mb, best, res);
}
