/*
 * The matmul of a dense bfloat16 weight on the CPU (built into the library
 * of library.py beside cpu_kernels.c): out[rows, N] = x[rows, K] @ W.T
 * for W [N, K] bfloat16 as torch holds it (rows of K values, a row stride,
 * no copy), x float32 or bfloat16, out float32 or bfloat16.
 *
 * Each output is one row of x against one row of W, 32 inputs at a time
 * into one float32 vector, that vector summed at the end by one tree: a fixed order,
 * so an output does not depend on the other rows of x nor on the thread
 * count (rows of W are spread over OpenMP threads, each computed by one).
 * With AVX512-BF16 the products are vdpbf16ps's (x rounded to bfloat16 on
 * the way in); elsewhere (AVX512F, AVX2 with FMA, plain C) the weights are
 * widened and x stays float32. Its use: float32 logits from a bfloat16 LM
 * head, which torch's bfloat16 matmul rounds to bfloat16 (steps of 0.125
 * at a logit of 20: ties that float32 separates).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DENSE_ISA 1
#include <immintrin.h>
#elif defined(__AVX512F__)
#define DENSE_ISA 2
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define DENSE_ISA 3
#include <immintrin.h>
#else
#define DENSE_ISA 0
#endif

enum { DENSE_FLOAT32 = 0, DENSE_BFLOAT16 = 1 };
#define ROW_TILE 4   /* rows of x per pass */
#if DENSE_ISA == 1
#define W_TILE 6     /* rows of W per pass: 24 accumulators, 10 loads per 24 products */
#define ACC_GROUPS 2 /* sum16 networks per tile */
#else
#define W_TILE 4     /* rows of W per pass */
#endif
#define MIN_PARALLEL_WORK (1 << 16)

typedef struct {
    const bf16_t* weight;
    int64_t out_features, in_features, weight_stride;
    const void* x;
    int64_t x_dtype, x_stride;
    void* out;
    int64_t out_dtype, out_stride;
    int64_t rows;
    int64_t num_threads;
} DenseMatmulArgs;

int asyncstep_dense_matmul_isa(void) { return DENSE_ISA; }

static inline float load_value(const void* x, int64_t dtype, int64_t i) {
    return dtype == DENSE_BFLOAT16 ? bf16_to_f32(((const bf16_t*)x)[i]) : ((const float*)x)[i];
}

static inline void store_value(void* out, int64_t dtype, int64_t i, float v) {
    if (dtype == DENSE_BFLOAT16)
        ((bf16_t*)out)[i] = f32_to_bf16(v);
    else
        ((float*)out)[i] = v;
}

#if DENSE_ISA == 1
/* x rows as bfloat16 (K values each, zero-padded to a multiple of 32). */
typedef bf16_t XValue;
static inline XValue to_x(float v) { return f32_to_bf16(v); }

/* Sixteen accumulators' lanes summed by one network (halves of 256, then of
 * 128, then of 64 bits, then pairs): every output gets the same tree,
 * l[i] + l[i+8], + (l[i+4] + l[i+12]), then those pairs, whichever of the
 * sixteen slots it holds. out[p] = the sum of v[p]'s lanes. */
static inline __attribute__((always_inline)) void sum16(const __m512 v[16], float out[16]) {
    __m512 s[8], t[4], u[2];
    for (int j = 0; j < 8; j++)
        s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++) {
        const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
        u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88),
                                   _mm512_shuffle_ps(u[0], u[1], 0xDD));
    /* lane 4j + m holds output j + 4m */
    const __m512i where = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(where, w));
}

/* sums[i][e] = W row i . x row e for nw (<= W_TILE) rows of W and `rows`
 * (<= ROW_TILE) rows of x: one accumulator each along K (32 at a time, in
 * order), then every accumulator through sum16 (unused ones zero). */
static inline __attribute__((always_inline)) void dot_tile_n(
    const bf16_t* const* w, const int nw, const XValue* x, int64_t kp, const int rows,
    float sums[W_TILE][ROW_TILE]) {
    __m512 acc[ACC_GROUPS * 16];
    for (int j = 0; j < ACC_GROUPS * 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; k += 32) {
        __m512bh xv[ROW_TILE];
        for (int e = 0; e < rows; e++) xv[e] = (__m512bh)_mm512_loadu_si512(x + e * kp + k);
        for (int i = 0; i < nw; i++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[i] + k);
            for (int e = 0; e < rows; e++)
                acc[i * ROW_TILE + e] = _mm512_dpbf16_ps(acc[i * ROW_TILE + e], wv, xv[e]);
        }
    }
    float flat[ACC_GROUPS * 16];
    for (int g = 0; g * 16 < nw * ROW_TILE; g++) sum16(acc + 16 * g, flat + 16 * g);
    for (int i = 0; i < nw; i++)
        for (int e = 0; e < rows; e++) sums[i][e] = flat[i * ROW_TILE + e];
}

/* dot_tile_n with constant counts (its accumulators in registers). */
static void dot_tile(const bf16_t* const* w, int nw, const XValue* x, int64_t kp, int rows,
                     float sums[W_TILE][ROW_TILE]) {
    switch (nw * 8 + rows) {
#define CASE(NW, ROWS) \
    case NW * 8 + ROWS: dot_tile_n(w, NW, x, kp, ROWS, sums); break;
#define CASES(NW) CASE(NW, 1) CASE(NW, 2) CASE(NW, 3) CASE(NW, 4)
        CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6)
#undef CASES
#undef CASE
    }
}
#else
/* x rows as float32 (K values each, zero-padded to a multiple of 32). */
typedef float XValue;
static inline XValue to_x(float v) { return v; }

#if DENSE_ISA == 2
static inline __m512 widen16(const bf16_t* p) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void dot_row(const bf16_t* w, const XValue* x, int64_t kp, int rows,
                            float* sums) {
    __m512 acc[ROW_TILE];
    for (int e = 0; e < rows; e++) acc[e] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; k += 32) {
        const __m512 w0 = widen16(w + k), w1 = widen16(w + k + 16);
        for (int e = 0; e < rows; e++) {
            acc[e] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + e * kp + k), acc[e]);
            acc[e] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + e * kp + k + 16), acc[e]);
        }
    }
    for (int e = 0; e < rows; e++) sums[e] = _mm512_reduce_add_ps(acc[e]);
}
#elif DENSE_ISA == 3
static inline __m256 widen8(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float sum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

static inline void dot_row(const bf16_t* w, const XValue* x, int64_t kp, int rows,
                            float* sums) {
    __m256 acc[ROW_TILE];
    for (int e = 0; e < rows; e++) acc[e] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kp; k += 32)
        for (int j = 0; j < 32; j += 8) {
            const __m256 wv = widen8(w + k + j);
            for (int e = 0; e < rows; e++)
                acc[e] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + e * kp + k + j), acc[e]);
        }
    for (int e = 0; e < rows; e++) sums[e] = sum8(acc[e]);
}
#else
static inline void dot_row(const bf16_t* w, const XValue* x, int64_t kp, int rows,
                            float* sums) {
    for (int e = 0; e < rows; e++) {
        float lanes[32] = {0};
        for (int64_t k = 0; k < kp; k += 32)
            for (int i = 0; i < 32; i++)
                lanes[i] = __builtin_fmaf(bf16_to_f32(w[k + i]), x[e * kp + k + i], lanes[i]);
        float sum = 0.0f;
        for (int i = 0; i < 32; i++) sum += lanes[i];
        sums[e] = sum;
    }
}
#endif

static inline void dot_tile(const bf16_t* const* w, int nw, const XValue* x, int64_t kp,
                            int rows, float sums[W_TILE][ROW_TILE]) {
    for (int i = 0; i < nw; i++) {
        float row_sums[ROW_TILE];
        dot_row(w[i], x, kp, rows, row_sums);
        for (int e = 0; e < rows; e++) sums[i][e] = row_sums[e];
    }
}
#endif

/* out = x @ W.T; 0 on success, -1 when scratch memory cannot be had or the
 * arguments are out of range (nothing written). */
int asyncstep_dense_matmul(const DenseMatmulArgs* a) {
    const int64_t N = a->out_features, K = a->in_features, rows = a->rows;
    if (N < 0 || K < 1 || rows < 0 || a->weight_stride < K) return -1;
    if (rows == 0 || N == 0) return 0;
    const int64_t kp = (K + 31) / 32 * 32; /* padded: whole vectors */
    XValue* x = aligned_alloc(64, (size_t)((rows * kp * (int64_t)sizeof(XValue) + 63) / 64 * 64));
    if (x == NULL) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < kp; k++)
            x[r * kp + k] = to_x(k < K ? load_value(a->x, a->x_dtype, r * a->x_stride + k) : 0.0f);
    const int padded = kp != K;
    const int num_threads = rows * N * K < MIN_PARALLEL_WORK ? 1 : (int)a->num_threads;
    int failed = 0;
    const int64_t tiles = (N + W_TILE - 1) / W_TILE;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        /* rows of W whose last vector would read past K: copied, zero-padded */
        bf16_t* copies = padded ? calloc((size_t)(W_TILE * kp), sizeof(bf16_t)) : NULL;
        if (padded && copies == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (padded && copies == NULL) continue;
            const int64_t n0 = tile * W_TILE;
            const int nw = N - n0 < W_TILE ? (int)(N - n0) : W_TILE;
            const bf16_t* w[W_TILE];
            for (int i = 0; i < nw; i++) {
                w[i] = a->weight + (n0 + i) * a->weight_stride;
                if (padded) {
                    memcpy(copies + i * kp, w[i], sizeof(bf16_t) * (size_t)K);
                    w[i] = copies + i * kp;
                }
            }
            for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
                const int count = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
                float sums[W_TILE][ROW_TILE];
                dot_tile(w, nw, x + r0 * kp, kp, count, sums);
                for (int e = 0; e < count; e++)
                    for (int i = 0; i < nw; i++)
                        store_value(a->out, a->out_dtype, (r0 + e) * a->out_stride + n0 + i,
                                    sums[i][e]);
            }
        }
        free(copies);
    }
    free(x);
    return failed ? -1 : 0;
}
