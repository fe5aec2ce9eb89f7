/*
 * The matmul of a dense bfloat16 weight on the CPU (built into the library
 * of library.py beside cpu_kernels.c): out[rows, N] = x[rows, K] @ W.T
 * for W [N, K] bfloat16 as torch holds it (rows of K values, a row stride,
 * no copy), x float32 or bfloat16, out float32 or bfloat16.
 *
 * Each output is one row of x against one row of W along K in one order,
 * into one float32 vector (AVX512-BF16: 8 lanes, 16 inputs a step; AVX512F
 * and AVX2: 16 or 8 lanes, twice as many inputs a step, the even k's
 * products then the odd k's; plain C: 32 lanes, 32 inputs a step), that
 * vector summed at the end by one tree (8 lanes: (l[i] + l[i+4]), then
 * (0 + 2) + (1 + 3); AVX512F folds i + 8 onto i first); tiles of rows of x
 * by rows of W (4 x 6 with AVX512-BF16; with AVX2 and AVX512F a width for
 * each count of rows, the registers' worth) share the loads, never the
 * sums, and every slot of a tile, leftover tiles too, gives an output the
 * same tree. Rows of W run in blocks (L2's worth) against every tile of x's
 * rows, chunks of x's rows in turn; up to STREAM_MAX_ROWS rows of x, tiles
 * one row of W wide (W read in memory's order). From outer_min_rows rows AVX512-BF16
 * packs W into pairs of K and sums outer products, one accumulator per lane
 * of the few-row kernel: the same sums, bit for bit, at oneDNN's blocking's
 * speed (outer_matmul); from PACK_MIN_ROWS the AVX2 build widens a block of
 * W to float32 once for all the rows (pack_rows: the values its few-row
 * tiles widen in registers, the same products in the same order, in wider
 * tiles with the registers the widening took). So an
 * output does not depend on the other rows of x (the batch: issue 40) nor
 * on the thread count (rows of W are spread over OpenMP threads, never K).
 * With AVX512-BF16 the products are vdpbf16ps's (x rounded to bfloat16 on
 * the way in); elsewhere the weights are widened and x stays float32; the
 * builds differ from each other, each alike for every batch. Its uses: every
 * dense bfloat16 projection of the CPU op set, and float32 logits from a
 * bfloat16 LM head, which torch's bfloat16 matmul rounds to bfloat16 (steps
 * of 0.125 at a logit of 20: ties that float32 separates). No AMX path
 * (untested: the machines at hand have none).
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
#elif DENSE_ISA == 2
#define W_TILE 6     /* at most (tile_width; 32 registers) */
#else
#define W_TILE 6     /* at most (AVX2: tile_width; 16 registers) */
#endif
#define W_GROUP 12   /* every tile width divides it */
/* Up to this many rows of x W's rows are read one at a time, in memory's
 * order (tiles one row of W wide): a decode step's weights stream from
 * DRAM, and several rows at once halved the rate the hardware streams them
 * at (benchmarks/results/cpu/dense_avx2_1205). */
#ifndef STREAM_MAX_ROWS
#define STREAM_MAX_ROWS 8
#endif
#if DENSE_ISA == 3
/* From this many rows (every count that does not stream W a row at a time)
 * the AVX2 build widens W's blocks to float32 once (pack_rows) for all of
 * them, and runs 4 x 3 tiles (4 x 2 where it would widen in registers: the mask
 * and the halves take the registers; 9 rather than 32: a decode step's
 * projections at 9-31 rows, benchmarks/results/cpu/dense_avx2_1205b).
 * AVX512F widens in registers at every row count (packing gained nothing
 * measured: benchmarks/results/cpu/dense_avx2_1205). */
#ifndef PACK_MIN_ROWS
#define PACK_MIN_ROWS (STREAM_MAX_ROWS + 1)
#endif
#define PACKS 1
#else
#define PACKS 0 /* (the AVX512-BF16 build packs its own way: outer_matmul) */
#endif
#ifndef BLOCK_BYTES
#define BLOCK_BYTES (96 << 10) /* rows of W a thread runs every row of x against (L2) */
#endif
#ifndef X_CHUNK_BYTES
#define X_CHUNK_BYTES (512 << 10) /* rows of x run against every block in turn */
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
    int64_t outer_min_rows; /* AVX512-BF16: outer products from this many rows (0: OUTER_MIN_ROWS) */
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

/* sums[i][e] = W row i . x row e for nw (<= W_TILE) rows of W and `rows`
 * (<= ROW_TILE) rows of x: one 8-lane accumulator each along K (16 at a
 * time, in order; 256-bit vdpbf16ps: Zen 4 issues two a cycle, and their
 * sums cost half a 512-bit network), then every accumulator through sum8
 * (unused ones zero). */
static inline __attribute__((always_inline)) void dot_tile_n(
    const bf16_t* const* w, const int nw, const XValue* x, int64_t kp, const int rows,
    float sums[W_TILE][ROW_TILE]) {
    __m256 acc[W_TILE * ROW_TILE];
    for (int j = 0; j < W_TILE * ROW_TILE; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kp; k += 16) {
        __m256bh xv[ROW_TILE];
        for (int e = 0; e < rows; e++)
            xv[e] = (__m256bh)_mm256_loadu_si256((const __m256i*)(x + e * kp + k));
        for (int i = 0; i < nw; i++) {
            const __m256bh wv = (__m256bh)_mm256_loadu_si256((const __m256i*)(w[i] + k));
            for (int e = 0; e < rows; e++)
                acc[i * ROW_TILE + e] = _mm256_dpbf16_ps(acc[i * ROW_TILE + e], wv, xv[e]);
        }
    }
    float flat[W_TILE * ROW_TILE];
    for (int g = 0; g * 8 < nw * ROW_TILE; g++) sum8(acc + 8 * g, flat + 8 * g);
    for (int i = 0; i < nw; i++)
        for (int e = 0; e < rows; e++) sums[i][e] = flat[i * ROW_TILE + e];
}

/* dot_tile_n with constant counts (its accumulators in registers). */
static void dot_tile(const void* const* w, int packed, int nw, const XValue* x, int64_t kp,
                     int rows, float sums[W_TILE][ROW_TILE]) {
    (void)packed;
    switch (nw * 8 + rows) {
#define CASE(NW, ROWS) \
    case NW * 8 + ROWS: dot_tile_n((const bf16_t* const*)w, NW, x, kp, ROWS, sums); break;
#define CASES(NW) CASE(NW, 1) CASE(NW, 2) CASE(NW, 3) CASE(NW, 4)
        CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6)
#undef CASES
#undef CASE
    }
}

static inline int tile_width(int rows, int packed) { (void)rows; (void)packed; return W_TILE; }
#else
/* x rows as float32 (K values each, zero-padded to a multiple of 32). */
typedef float XValue;
static inline XValue to_x(float v) { return v; }

#if DENSE_ISA == 2 || DENSE_ISA == 3
#if DENSE_ISA == 2
#define LANES 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
/* 32 bfloat16 of W as float32: the even k (the low halves of the 32-bit
 * words, shifted up) or the odd k (the high halves, masked). */
static inline vec vwiden(const bf16_t* p, int odd) {
    const __m512i u = _mm512_loadu_si512((const void*)p);
    return _mm512_castsi512_ps(odd ? _mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u))
                                   : _mm512_slli_epi32(u, 16));
}
/* lane i + lane i + 8: 8 lanes for sum8 */
static inline __m256 vfold(vec v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
#define LANES 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
/* 16 bfloat16 of W as float32: the even k or the odd k (as the AVX512F build's). */
static inline vec vwiden(const bf16_t* p, int odd) {
    const __m256i u = _mm256_loadu_si256((const __m256i*)p);
    return _mm256_castsi256_ps(odd ? _mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u))
                                   : _mm256_slli_epi32(u, 16));
}
static inline __m256 vfold(vec v) { return v; }
#endif
#define STEP (2 * LANES) /* k per step: one vector of W's bfloat16 pairs */

/* Which k a prepared row of x holds at k: per STEP, the even k then the odd. */
static inline int64_t x_slot(int64_t k) {
    const int64_t j = k % STEP;
    return k - j + (j & 1) * LANES + j / 2;
}

/* sums[i][e] = W row i . x row e for nw rows of W and `rows` rows of x
 * (constants where inlined): one float32 vector per output along K, a STEP
 * at a time in order (the even k's products, then the odd k's: x prepared
 * as x_slot), lanes folded to 8 (AVX512F: i + 8 onto i) and summed by sum8,
 * whichever slot of the tile the output holds. W's rows as bfloat16
 * (widened here) or, `packed`, as float32 in x_slot's order (pack_rows):
 * the same values, the same products in the same order. */
static inline __attribute__((always_inline)) void dot_tile_n(
    const void* const* w, const int packed, const int nw, const XValue* x, int64_t kp,
    const int rows, float sums[W_TILE][ROW_TILE]) {
    vec acc[ROW_TILE][W_TILE];
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) acc[e][i] = vzero();
    for (int64_t k = 0; k < kp; k += STEP)
        for (int half = 0; half < 2; half++) { /* the even k's products, then the odd k's */
            vec wv[W_TILE];
            for (int i = 0; i < nw; i++)
                wv[i] = packed ? vload((const float*)w[i] + k + half * LANES)
                               : vwiden((const bf16_t*)w[i] + k, half);
            for (int e = 0; e < rows; e++) {
                const vec xv = vload(x + e * kp + k + half * LANES);
                for (int i = 0; i < nw; i++) acc[e][i] = vfma(wv[i], xv, acc[e][i]);
            }
        }
    __m256 lanes[((W_TILE * ROW_TILE + 7) / 8) * 8];
    float flat[((W_TILE * ROW_TILE + 7) / 8) * 8];
    const int used = nw * rows, groups = (used + 7) / 8;
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) lanes[e * nw + i] = vfold(acc[e][i]);
    for (int j = used; j < groups * 8; j++) lanes[j] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) sum8(lanes + 8 * g, flat + 8 * g);
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) sums[i][e] = flat[e * nw + i];
}

/* dot_tile_n with constant counts (its accumulators in registers). */
static void dot_tile(const void* const* w, int packed, int nw, const XValue* x, int64_t kp,
                     int rows, float sums[W_TILE][ROW_TILE]) {
    switch (packed * 64 + nw * 8 + rows) {
#define CASE(P, NW, ROWS) \
    case P * 64 + NW * 8 + ROWS: dot_tile_n(w, P, NW, x, kp, ROWS, sums); break;
#define CASES(P, NW) CASE(P, NW, 1) CASE(P, NW, 2) CASE(P, NW, 3) CASE(P, NW, 4)
        CASES(0, 1) CASES(0, 2) CASES(0, 3) CASES(0, 4) CASES(0, 5) CASES(0, 6)
#if PACKS
        CASES(1, 1) CASES(1, 2) CASES(1, 3) CASES(1, 4) CASES(1, 5) CASES(1, 6)
#endif
#undef CASES
#undef CASE
    }
}

/* Rows of W per tile for a tile of `rows` rows of x: the accumulators, W's
 * vectors, one of x and the widening's mask in the registers, none spilled
 * (16 with AVX2, 32 with AVX512F); each divides W_GROUP. */
static inline int tile_width(int rows, int packed) {
#if DENSE_ISA == 2
    (void)packed;
    return rows == 4 ? 4 : 6;
#else
    return rows == 1 ? 6 : rows == 2 ? 4 : rows == 3 || packed ? 3 : 2;
#endif
}


#if PACKS
/* rows[i][x_slot(k)] = W row n0 + i's k as float32, zero from K to kp. */
static void pack_rows(const DenseMatmulArgs* a, int64_t n0, int64_t nb, int64_t kp,
                      float* rows) {
    const int64_t K = a->in_features;
    for (int64_t i = 0; i < nb; i++) {
        const bf16_t* src = a->weight + (n0 + i) * a->weight_stride;
        float* dst = rows + i * kp;
        for (int64_t k0 = 0; k0 < kp; k0 += STEP) {
            if (k0 + STEP <= K) {
                const bf16_t* p = src + k0;
                for (int half = 0; half < 2; half++) vstore(dst + k0 + half * LANES, vwiden(p, half));
            } else {
                for (int j = 0; j < STEP; j++)
                    dst[k0 + (j & 1) * LANES + j / 2] = k0 + j < K ? bf16_to_f32(src[k0 + j]) : 0.0f;
            }
        }
    }
}
#endif
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

static inline int64_t x_slot(int64_t k) { return k; }

static inline void dot_tile(const void* const* w, int packed, int nw, const XValue* x,
                            int64_t kp, int rows, float sums[W_TILE][ROW_TILE]) {
    (void)packed;
    for (int i = 0; i < nw; i++) {
        float row_sums[ROW_TILE];
        dot_row((const bf16_t*)w[i], x, kp, rows, row_sums);
        for (int e = 0; e < rows; e++) sums[i][e] = row_sums[e];
    }
}

static inline int tile_width(int rows, int packed) { (void)rows; (void)packed; return W_TILE; }
#endif
#endif

#if DENSE_ISA == 1
/* f32_to_bf16 on 16 values at once (round to nearest even, NaNs quiet). */
static inline __m256i round_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* Many rows: the same sums as dot_tile_n's, bit for bit, the other way
 * round. 16 rows of W are packed as pairs of K ([K/2][16] 32-bit words,
 * zero past K and past N); an output's 8 accumulators (one per lane of
 * dot_tile_n's: pair p goes to accumulator p % 8, in order) take a pair of
 * x broadcast against the panel's 16 outputs; then the 8 are added as sum8
 * adds a vector's lanes ((a[i] + a[i+4]), then (0 + 2) + (1 + 3)). No
 * horizontal sums, 16 contiguous outputs per store: what oneDNN's blocking
 * buys, without its row-count-dependent K order. */
/* From here the packing pays on Zen 4 (16: even; benchmarks/studies/cpu_dense);
 * the caller may set another (on an AMX Xeon from 4 rows: outer_min_rows). */
#define OUTER_MIN_ROWS 32
#define OUTER_ROWS 3      /* rows of x per pass: 24 accumulators */
#define PANEL 16          /* rows of W per panel */

/* panel[p][n] = W row n0 + n's pair p (the 16 pairs of 16 rows a block:
 * loaded, masked past K and zero past nw, then transposed as 32-bit words). */
static void pack_panel(const DenseMatmulArgs* a, int64_t n0, int nw, int64_t kp,
                       uint32_t* panel) {
    const int64_t K = a->in_features;
    for (int64_t k0 = 0; k0 < kp; k0 += 32) {
        const int64_t left = K - k0;
        const __mmask32 mask = left >= 32 ? (__mmask32)0xFFFFFFFFu : ((__mmask32)1 << left) - 1;
        __m512i r[PANEL], t[PANEL], u[PANEL];
        for (int n = 0; n < PANEL; n++)
            r[n] = n < nw ? _mm512_maskz_loadu_epi16(
                                mask, a->weight + (n0 + n) * a->weight_stride + k0)
                          : _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) { /* rows 2i, 2i+1: [a0 b0 a1 b1], [a2 b2 a3 b3] */
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        for (int g = 0; g < 4; g++) { /* u[4g + m]: column 4L + m of rows 4g..4g+3 */
            u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
            u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
            u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
            u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
        }
        uint32_t* out = panel + k0 / 2 * PANEL;
        for (int m = 0; m < 4; m++) { /* 128-bit lane L of group g -> column 4L + m */
            const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
            const __m512i x1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
            const __m512i x2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
            const __m512i x3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
            _mm512_storeu_si512(out + (0 + m) * PANEL, _mm512_shuffle_i32x4(x0, x2, 0x88));
            _mm512_storeu_si512(out + (4 + m) * PANEL, _mm512_shuffle_i32x4(x0, x2, 0xDD));
            _mm512_storeu_si512(out + (8 + m) * PANEL, _mm512_shuffle_i32x4(x1, x3, 0x88));
            _mm512_storeu_si512(out + (12 + m) * PANEL, _mm512_shuffle_i32x4(x1, x3, 0xDD));
        }
    }
}

static inline __m512 add_exact(__m512 a, __m512 b) { /* never reassociated */
    return _mm512_add_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static inline __attribute__((always_inline)) void outer_tile_n(
    const uint32_t* panel, const XValue* x, int64_t kp, const int rows,
    float out[OUTER_ROWS][PANEL]) {
    __m512 acc[OUTER_ROWS][8];
    for (int e = 0; e < OUTER_ROWS; e++)
        for (int j = 0; j < 8; j++) acc[e][j] = _mm512_setzero_ps();
    const int64_t pairs = kp / 2;
    for (int64_t p = 0; p < pairs; p += 8)
        for (int j = 0; j < 8; j++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(panel + (p + j) * PANEL);
            for (int e = 0; e < rows; e++) {
                const uint32_t* xe = (const uint32_t*)(x + e * kp);
                acc[e][j] = _mm512_dpbf16_ps(acc[e][j], wv,
                                             (__m512bh)_mm512_set1_epi32((int)xe[p + j]));
            }
        }
    for (int e = 0; e < rows; e++) {
        __m512 q[4];
        for (int i = 0; i < 4; i++) q[i] = add_exact(acc[e][i], acc[e][i + 4]);
        _mm512_storeu_ps(out[e], add_exact(add_exact(q[0], q[2]), add_exact(q[1], q[3])));
    }
}

static void outer_tile(const uint32_t* panel, const XValue* x, int64_t kp, int rows,
                       float out[OUTER_ROWS][PANEL]) {
    switch (rows) {
        case 1: outer_tile_n(panel, x, kp, 1, out); break;
        case 2: outer_tile_n(panel, x, kp, 2, out); break;
        default: outer_tile_n(panel, x, kp, 3, out); break;
    }
}

/* out[at .. at + nw) = v, rounded as store_value rounds (f32_to_bf16). */
static inline void store_panel(const DenseMatmulArgs* a, int64_t at, int nw, const float* v) {
    const __mmask16 mask = (__mmask16)((1u << nw) - 1);
    const __m512 f = _mm512_loadu_ps(v);
    if (a->out_dtype != DENSE_BFLOAT16) {
        _mm512_mask_storeu_ps((float*)a->out + at, mask, f);
        return;
    }
    _mm256_mask_storeu_epi16((bf16_t*)a->out + at, mask, round_bf16(f));
}

/* Every row of x against the panels of W, panels spread over threads. */
static int outer_matmul(const DenseMatmulArgs* a, const XValue* x, int64_t kp, int num_threads) {
    const int64_t N = a->out_features, rows = a->rows;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        uint32_t* panel = aligned_alloc(64, (size_t)(kp / 2 * PANEL * 4));
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < panels; t++) {
            if (panel == NULL) continue;
            const int64_t n0 = t * PANEL;
            const int nw = N - n0 < PANEL ? (int)(N - n0) : PANEL;
            pack_panel(a, n0, nw, kp, panel);
            for (int64_t r0 = 0; r0 < rows; r0 += OUTER_ROWS) {
                const int count = rows - r0 < OUTER_ROWS ? (int)(rows - r0) : OUTER_ROWS;
                float out[OUTER_ROWS][PANEL];
                outer_tile(panel, x + r0 * kp, kp, count, out);
                for (int e = 0; e < count; e++)
                    store_panel(a, (r0 + e) * a->out_stride + n0, nw, out[e]);
            }
        }
        free(panel);
    }
    return failed ? -1 : 0;
}
#endif

#if DENSE_ISA == 1
/* Row r of x as bfloat16, zero from K to kp (to_x of every value, 16 at once). */
static void prepare_row(const DenseMatmulArgs* a, int64_t r, int64_t kp, XValue* row) {
    const int64_t K = a->in_features;
    if (a->x_dtype == DENSE_BFLOAT16) {
        memcpy(row, (const bf16_t*)a->x + r * a->x_stride, sizeof(bf16_t) * (size_t)K);
        memset(row + K, 0, sizeof(bf16_t) * (size_t)(kp - K));
        return;
    }
    const float* src = (const float*)a->x + r * a->x_stride;
    for (int64_t k = 0; k < kp; k += 16) {
        const int64_t left = K - k;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF
                                          : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        _mm256_storeu_si256((__m256i*)(row + k), round_bf16(_mm512_maskz_loadu_ps(mask, src + k)));
    }
}
#else
#if DENSE_ISA == 2 || DENSE_ISA == 3
/* Row r of x as float32, zero from K to kp, in x_slot's order (a STEP at a time). */
static void prepare_row(const DenseMatmulArgs* a, int64_t r, int64_t kp, XValue* row) {
    const int64_t K = a->in_features;
    for (int64_t k0 = 0; k0 < kp; k0 += STEP) {
        float v[STEP];
        if (a->x_dtype == DENSE_BFLOAT16) {
            const bf16_t* src = (const bf16_t*)a->x + r * a->x_stride;
            for (int j = 0; j < STEP; j++) v[j] = k0 + j < K ? bf16_to_f32(src[k0 + j]) : 0.0f;
        } else {
            const float* src = (const float*)a->x + r * a->x_stride;
            for (int j = 0; j < STEP; j++) v[j] = k0 + j < K ? src[k0 + j] : 0.0f;
        }
        for (int j = 0; j < LANES; j++) {
            row[k0 + j] = v[2 * j];
            row[k0 + LANES + j] = v[2 * j + 1];
        }
    }
}
#else
/* Row r of x as float32, zero from K to kp. */
static void prepare_row(const DenseMatmulArgs* a, int64_t r, int64_t kp, XValue* row) {
    for (int64_t k = 0; k < kp; k++)
        row[k] = to_x(k < a->in_features ? load_value(a->x, a->x_dtype, r * a->x_stride + k) : 0.0f);
}
#endif
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
    for (int64_t r = 0; r < rows; r++) prepare_row(a, r, kp, x + r * kp);
    const int num_threads = rows * N * K < MIN_PARALLEL_WORK ? 1 : (int)a->num_threads;
#if DENSE_ISA == 1
    if (rows >= (a->outer_min_rows > 0 ? a->outer_min_rows : OUTER_MIN_ROWS)) {
        const int status = outer_matmul(a, x, kp, num_threads);
        free(x);
        return status;
    }
#endif
#if PACKS
    const int packed = rows >= PACK_MIN_ROWS;
#else
    const int packed = 0;
#endif
    const int padded = kp != K;
    /* blocks of W_GROUP-multiple rows of W (BLOCK_BYTES of bfloat16, at least one per
     * thread), each run against every tile of rows of x, tile after tile of W */
    int64_t block = BLOCK_BYTES / (kp * (int64_t)sizeof(bf16_t)) / W_GROUP * W_GROUP;
    const int64_t share = (N + num_threads - 1) / num_threads;
    if (block > share) block = (share + W_GROUP - 1) / W_GROUP * W_GROUP;
    if (block < W_GROUP) block = W_GROUP;
    const int64_t blocks = (N + block - 1) / block;
    /* many rows: chunks of x (X_CHUNK_BYTES, L2) each against every block */
    int64_t chunk = X_CHUNK_BYTES / (kp * (int64_t)sizeof(XValue)) / ROW_TILE * ROW_TILE;
    if (chunk < ROW_TILE) chunk = ROW_TILE;
    /* W's rows as read: packed (float32), copied where the last vector would read
     * past K (bfloat16, zero-padded), else in place */
    const size_t scratch_bytes =
        packed ? sizeof(float) * (size_t)(block * kp)
               : padded ? sizeof(bf16_t) * (size_t)(block * kp) : 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        void* scratch = scratch_bytes ? aligned_alloc(64, (scratch_bytes + 63) / 64 * 64) : NULL;
        const void** w = malloc(sizeof(*w) * (size_t)block);
        const int ok = (scratch_bytes == 0 || scratch != NULL) && w != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        if (padded && !packed && scratch != NULL) memset(scratch, 0, scratch_bytes);
        for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
#pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) {
                if (!ok) continue;
                const int64_t n0 = b * block;
                const int64_t nb = N - n0 < block ? N - n0 : block;
#if PACKS
                if (packed) pack_rows(a, n0, nb, kp, scratch);
#endif
                for (int64_t i = 0; i < nb; i++) {
                    if (packed) {
                        w[i] = (const float*)scratch + i * kp;
                    } else if (padded) {
                        bf16_t* copy = (bf16_t*)scratch + i * kp;
                        memcpy(copy, a->weight + (n0 + i) * a->weight_stride,
                               sizeof(bf16_t) * (size_t)K);
                        w[i] = copy;
                    } else {
                        w[i] = a->weight + (n0 + i) * a->weight_stride;
                    }
                }
                const int64_t end = rows - c0 < chunk ? rows : c0 + chunk;
                for (int64_t r0 = c0; r0 < end; r0 += ROW_TILE) {
                    const int count = end - r0 < ROW_TILE ? (int)(end - r0) : ROW_TILE;
                    const int width = rows <= STREAM_MAX_ROWS ? 1 : tile_width(count, packed);
                    for (int64_t i0 = 0; i0 < nb; i0 += width) {
                        const int nw = nb - i0 < width ? (int)(nb - i0) : width;
                        float sums[W_TILE][ROW_TILE];
                        dot_tile(w + i0, packed, nw, x + r0 * kp, kp, count, sums);
                        for (int e = 0; e < count; e++)
                            for (int i = 0; i < nw; i++)
                                store_value(a->out, a->out_dtype,
                                            (r0 + e) * a->out_stride + n0 + i0 + i, sums[i][e]);
                    }
                }
            }
        }
        free(scratch);
        free(w);
    }
    free(x);
    return failed ? -1 : 0;
}
