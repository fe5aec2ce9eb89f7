/* An AVX2 core's ceilings for the quantized matmul's two-level dot products
 * (cpu_quant.c's AVX2 build): independent ymm vpmaddubsw, vpmaddwd and
 * vfmadd231ps a cycle (12 a round), and the kernel's inner round for one
 * row and 8 outputs of a block (2 levels x 8 vpmaddubsw + 7 vpaddw each,
 * 2 vpmaddwd, shift, add, convert, multiply, 2 FMAs) in cycles, at --ghz
 * (a dependent add chain's clock: see vnni_peak.c).
 *   cc -O2 -mavx2 -mfma avx2_peak.c -o /tmp/avx2_peak && /tmp/avx2_peak 3.0 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define X12(OP)                                                                              \
    OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define MADDUBS(i) "vpmaddubsw %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define MADDWD(i) "vpmaddwd %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define FMA(i) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define PADDW(i) "vpaddw %%ymm14, %%ymm" #i ", %%ymm" #i "\n\t"

/* One level of one row's block for 8 outputs: 8 vpmaddubsw into 2 chains of vpaddw. */
#define LEVEL(a, b)                                                                          \
    "vpmaddubsw %%ymm14, %%ymm15, %%ymm" #a "\n\t vpmaddubsw %%ymm13, %%ymm15, %%ymm" #b "\n\t" \
    "vpmaddubsw %%ymm12, %%ymm15, %%ymm10\n\t vpaddw %%ymm10, %%ymm" #a ", %%ymm" #a "\n\t"      \
    "vpmaddubsw %%ymm11, %%ymm15, %%ymm9\n\t vpaddw %%ymm9, %%ymm" #b ", %%ymm" #b "\n\t"        \
    "vpmaddubsw %%ymm14, %%ymm15, %%ymm10\n\t vpaddw %%ymm10, %%ymm" #a ", %%ymm" #a "\n\t"      \
    "vpmaddubsw %%ymm13, %%ymm15, %%ymm9\n\t vpaddw %%ymm9, %%ymm" #b ", %%ymm" #b "\n\t"        \
    "vpmaddubsw %%ymm12, %%ymm15, %%ymm10\n\t vpaddw %%ymm10, %%ymm" #a ", %%ymm" #a "\n\t"      \
    "vpmaddubsw %%ymm11, %%ymm15, %%ymm9\n\t vpaddw %%ymm9, %%ymm" #b ", %%ymm" #b "\n\t"        \
    "vpaddw %%ymm" #b ", %%ymm" #a ", %%ymm" #a "\n\t"
#define KERNEL_ROUND                                                                         \
    LEVEL(0, 1) LEVEL(2, 3)                                                                  \
    "vpmaddwd %%ymm8, %%ymm0, %%ymm0\n\t vpmaddwd %%ymm8, %%ymm2, %%ymm2\n\t"               \
    "vpslld $8, %%ymm0, %%ymm0\n\t vpaddd %%ymm2, %%ymm0, %%ymm0\n\t"                        \
    "vcvtdq2ps %%ymm0, %%ymm0\n\t vmulps %%ymm7, %%ymm6, %%ymm5\n\t"                         \
    "vfmadd231ps %%ymm0, %%ymm5, %%ymm4\n\t vfmadd231ps %%ymm7, %%ymm6, %%ymm4\n\t"

#define ROUND(NAME, BODY)                                                                    \
    static double NAME(long n) {                                                              \
        double t = now();                                                                     \
        for (long i = 0; i < n; i++) __asm__ volatile(BODY ::: "memory");                    \
        return now() - t;                                                                     \
    }
ROUND(maddubs, X12(MADDUBS))
ROUND(maddwd, X12(MADDWD))
ROUND(fmas, X12(FMA))
ROUND(paddw, X12(PADDW))
ROUND(kernel, KERNEL_ROUND)

static double chain(long n) { /* one dependent add a cycle: the clock */
    double t = now();
    long x = 0;
    for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0\n\t add $1, %0\n\t add $1, %0\n\t add $1, %0" : "+r"(x));
    return (now() - t) / 4;
}

int main(int argc, char** argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 0.0;
    const long n = 50000000;
    const double cyc = chain(n) / n;
    const double clock = ghz > 0 ? ghz : 1e-9 / cyc;
    printf("clock: %.2f GHz (%s)\n", clock, ghz > 0 ? "given" : "dependent adds");
    struct { const char* name; double (*f)(long); int per; } r[] = {
        {"vpmaddubsw ymm (12 independent)", maddubs, 12}, {"vpmaddwd ymm (12 independent)", maddwd, 12},
        {"vfmadd231ps ymm (12 independent)", fmas, 12}, {"vpaddw ymm (12 chains)", paddw, 12},
        {"kernel round (1 row, 8 outputs, 1 block, 2 levels)", kernel, 1}};
    for (int i = 0; i < 5; i++) {
        double best = 1e9;
        for (int k = 0; k < 3; k++) { double t = r[i].f(n / 10); if (t < best) best = t; }
        const double cycles = best * clock * 1e9 / (n / 10);
        printf("%-52s %6.2f cycles a round, %5.2f a cycle\n", r[i].name, cycles, r[i].per / cycles);
    }
    return 0;
}
