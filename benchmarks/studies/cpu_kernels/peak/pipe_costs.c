/* What a vpdpbusd loop pays for the other instructions beside it: 16
 * independent zmm vpdpbusd a round (the quantized matmul's two-level dot
 * product of one row, block and group of 16 outputs), alone and with the
 * extra instructions of its epilogue and unpacking, in cycles a round
 * (at --ghz, a dependent add chain's clock; clock.c-like: see vnni_peak.c).
 *   cc -O2 -march=native pipe_costs.c -o /tmp/pipe_costs && /tmp/pipe_costs 3.66 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int buf[1024] __attribute__((aligned(64)));

#define D16                                                                                   \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm1\n\t"             \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm2\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm3\n\t"             \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm4\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm5\n\t"             \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm6\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm7\n\t"             \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm8\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm9\n\t"             \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm10\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm11\n\t"           \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm12\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm13\n\t"           \
    "vpdpbusd %%zmm30, %%zmm31, %%zmm14\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm15\n\t"

#define ROUND(NAME, EXTRA)                                                                    \
    static double NAME(long n) {                                                              \
        double t = now();                                                                     \
        for (long i = 0; i < n; i++) __asm__ volatile(D16 EXTRA ::"r"(buf) : "memory");      \
        return now() - t;                                                                     \
    }
ROUND(alone, "")
ROUND(fma1, "vfmadd231ps %%zmm30, %%zmm31, %%zmm16\n\t")
ROUND(fma3, "vfmadd231ps %%zmm30, %%zmm31, %%zmm16\n\t vfmadd231ps %%zmm30, %%zmm31, %%zmm17\n\t"
            "vmulps %%zmm30, %%zmm31, %%zmm18\n\t")
ROUND(int8, "vpaddd %%zmm30, %%zmm16, %%zmm16\n\t vpaddd %%zmm30, %%zmm17, %%zmm17\n\t"
            "vpaddd %%zmm30, %%zmm18, %%zmm18\n\t vpslld $8, %%zmm19, %%zmm19\n\t"
            "vpandd %%zmm30, %%zmm20, %%zmm20\n\t vpsrlw $4, %%zmm21, %%zmm21\n\t"
            "vcvtdq2ps %%zmm22, %%zmm23\n\t vcvtph2ps (%0), %%zmm24\n\t")
ROUND(add1, "vaddps %%zmm30, %%zmm31, %%zmm16\n\t")
ROUND(scalef1, "vscalefps %%zmm30, %%zmm31, %%zmm16\n\t")
ROUND(move6, "vmovdqa32 %%zmm29, %%zmm16\n\t vmovdqa32 %%zmm29, %%zmm17\n\t"
             "vmovdqa32 %%zmm16, %%zmm18\n\t vmovdqa32 %%zmm17, %%zmm19\n\t"
             "vmovdqa32 %%zmm29, %%zmm20\n\t vmovdqa32 %%zmm20, %%zmm21\n\t")
ROUND(bcast_mem16, "vpbroadcastd 4(%0), %%zmm16\n\t vpbroadcastd 8(%0), %%zmm17\n\t"
                   "vpbroadcastd 12(%0), %%zmm18\n\t vpbroadcastd 16(%0), %%zmm19\n\t"
                   "vpbroadcastd 4(%0), %%zmm16\n\t vpbroadcastd 8(%0), %%zmm17\n\t"
                   "vpbroadcastd 12(%0), %%zmm18\n\t vpbroadcastd 16(%0), %%zmm19\n\t"
                   "vpbroadcastd 4(%0), %%zmm16\n\t vpbroadcastd 8(%0), %%zmm17\n\t"
                   "vpbroadcastd 12(%0), %%zmm18\n\t vpbroadcastd 16(%0), %%zmm19\n\t"
                   "vpbroadcastd 4(%0), %%zmm16\n\t vpbroadcastd 8(%0), %%zmm17\n\t"
                   "vpbroadcastd 12(%0), %%zmm18\n\t vpbroadcastd 16(%0), %%zmm19\n\t")
ROUND(bcast_reg16, "vpbroadcastd %%xmm29, %%zmm16\n\t vpbroadcastd %%xmm29, %%zmm17\n\t"
                   "vpbroadcastd %%xmm29, %%zmm18\n\t vpbroadcastd %%xmm29, %%zmm19\n\t"
                   "vpbroadcastd %%xmm29, %%zmm16\n\t vpbroadcastd %%xmm29, %%zmm17\n\t"
                   "vpbroadcastd %%xmm29, %%zmm18\n\t vpbroadcastd %%xmm29, %%zmm19\n\t"
                   "vpbroadcastd %%xmm29, %%zmm16\n\t vpbroadcastd %%xmm29, %%zmm17\n\t"
                   "vpbroadcastd %%xmm29, %%zmm18\n\t vpbroadcastd %%xmm29, %%zmm19\n\t"
                   "vpbroadcastd %%xmm29, %%zmm16\n\t vpbroadcastd %%xmm29, %%zmm17\n\t"
                   "vpbroadcastd %%xmm29, %%zmm18\n\t vpbroadcastd %%xmm29, %%zmm19\n\t")

int main(int argc, char** argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 3.66;
    const long n = 200000;
    struct { const char* name; double (*fn)(long); } rounds[] = {
        {"16 vpdpbusd alone", alone},
        {"+ 1 vfmadd231ps", fma1},
        {"+ 2 vfmadd231ps + 1 vmulps (the epilogue's float ops)", fma3},
        {"+ 3 vpaddd, vpslld, vpandd, vpsrlw, vcvtdq2ps, vcvtph2ps", int8},
        {"+ 1 vaddps", add1},
        {"+ 1 vscalefps", scalef1},
        {"+ 6 vmovdqa32 between registers", move6},
        {"+ 16 vpbroadcastd from memory", bcast_mem16},
        {"+ 16 vpbroadcastd from a register", bcast_reg16},
    };
    for (unsigned r = 0; r < sizeof(rounds) / sizeof(rounds[0]); r++) {
        double best = 1e9;
        for (int k = 0; k < 300; k++) {
            const double t = rounds[r].fn(n);
            if (t < best) best = t;
        }
        printf("%-58s %6.2f cycles a round\n", rounds[r].name, best / n * ghz * 1e9);
    }
    return 0;
}
