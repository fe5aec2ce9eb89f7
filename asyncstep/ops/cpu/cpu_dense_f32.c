/*
 * The matmul of a dense float32 weight on the CPU (built into the library
 * of library.py beside cpu_kernels.c): out[rows, N] = x[rows, K] @ W.T for
 * W [N, K] float32 as torch holds it (rows of K values, a row stride, no
 * copy), x float32 rows (a row stride), out float32 rows (a row stride).
 *
 * One order for every output, in every build: lane j of an 8-lane float32
 * accumulator takes k = j, j + 8, j + 16, ... in order, one fused
 * multiply-add each (the last step's missing k are zeros: 0 * 0 added),
 * then the 8 lanes are summed by one tree, (l[i] + l[i + 4]) for i < 4,
 * then (s0 + s2) + (s1 + s3). The AVX-512 build (AVX512F + VL: 512-bit
 * vectors, each two rows of x's 8 lanes against one row of W, 32
 * registers), the AVX2 + FMA build and the plain C build (fmaf per lane)
 * compute the same bits; they differ only in their tiles: rows of x by
 * rows of W that share the loads, never the sums (8 x 6 with AVX-512; with
 * AVX2 1 x 6, 2 x 4, 3 x 3 or 4 x 3 by the tile's rows, every tile that
 * wide; the next block of W prefetched in both; 1 x 1 in plain C), every
 * slot of a tile,
 * leftover tiles too, summed by the same tree. Rows of W run in blocks
 * (L2's worth) against every tile of x's rows, chunks of x's rows in turn;
 * rows of W are spread over OpenMP threads, never K. So an output depends
 * on its row of x and its row of W only: not on the other rows (the batch:
 * issue 40), the thread count or the build. Its uses:
 * every dense float32 projection of the CPU op set and the float32 LM head.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "cpu_f32.h"

#if defined(__AVX512F__) && defined(__AVX512VL__)
#define F32_ISA 2
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_ISA 3
#include <immintrin.h>
#else
#define F32_ISA 0
#endif

#define LANES 8

#if F32_ISA == 2 || F32_ISA == 3
#if F32_ISA == 2
/* 512-bit vectors, each two 8-lane accumulators: a pair of rows of x (the
 * low half row e, the high half row e + 1) against one row of W (its 8
 * values broadcast to both halves), so every lane takes the products the
 * 8-lane order gives it, twice the flops an instruction */
#define WIDE 1
#define ROW_TILE 8 /* rows of x per tile: 4 pairs */
#define W_TILE 6   /* rows of W per tile: 24 accumulators, 6 of W, 1 of x: 31 of 32 */
/* every tile W_TILE wide, the next block of W prefetched as the first tile
 * of x's rows runs (against an LM head faster than tiles one row of W wide
 * read in memory's order: benchmarks/results/cpu/f32_wide_1206) */
#ifndef PREFETCH
#define PREFETCH 1
#endif
#else
/* 16 registers: a tile of `rows` rows of x is tile_width(rows) rows of W
 * wide (1 x 6, 2 x 4, 3 x 3, 4 x 3: at most 12 accumulators, their W and
 * one of x), 6 to 12 independent multiply-add chains to hide the FMA's
 * latency; the next block of W's rows prefetched (PREFETCH) */
#define ROW_TILE 4
#define W_TILE 6
#define TILE_WIDTHS 1
/* x's vector too (not folded into each of its 3 multiply-adds as a load) */
#define KEEP_X(v) KEEP(v)
#ifndef PREFETCH
#define PREFETCH 1
#endif
static inline int tile_width(int rows) { return rows == 1 ? 6 : rows == 2 ? 4 : 3; }
#endif
typedef __m256 vec;
/* v held in a register: a tile's W vectors are loaded once a step, not
 * folded into each multiply-add as a load of its own (GCC's choice: 28
 * loads for 24 multiply-adds instead of 10; benchmarks/results/cpu/
 * f32dense_1205) */
#if F32_ISA == 2
#define KEEP(v) __asm__("" : "+v"(v))
#else
#define KEEP(v) __asm__("" : "+x"(v))
#endif
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
/* the first n (< LANES) values at p, zeros after */
static inline vec vload_part(const float* p, int n) {
#if F32_ISA == 2
    return _mm256_maskz_loadu_ps((__mmask8)((1u << n) - 1), p);
#else
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
#endif
}

/* out[p] = the sum of v[p]'s lanes, by cpu_common.h's one tree. */
static inline __attribute__((always_inline)) void vsum8(const vec v[8], float out[8]) {
    sum8(v, out);
}
#else
/* Plain C: the library's flags let the compiler reassociate loops of
 * scalars; GCC is told not to here, and every product is an fmaf. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#endif
#define ROW_TILE 1
#define W_TILE 1
typedef struct { float v[LANES]; } vec;
#define KEEP(v) ((void)0)
static inline vec vzero(void) { vec r; memset(&r, 0, sizeof r); return r; }
static inline vec vload(const float* p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vec vload_part(const float* p, int n) {
    vec r = vzero();
    memcpy(r.v, p, sizeof(float) * (size_t)n);
    return r;
}
static inline vec vfma(vec a, vec b, vec c) {
    for (int i = 0; i < LANES; i++) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
/* cpu_common.h's sum8's tree, lane by lane (its vector form needs AVX2) */
static __attribute__((noinline)) void vsum8(const vec v[8], float out[8]) {
    for (int p = 0; p < 8; p++) {
        float s[4];
        for (int i = 0; i < 4; i++) s[i] = v[p].v[i] + v[p].v[i + 4];
        out[p] = (s[0] + s[2]) + (s[1] + s[3]);
    }
}
#endif

#define W_GROUP 12 /* every tile width divides it */
#ifndef BLOCK_BYTES
#define BLOCK_BYTES (192 << 10) /* rows of W a thread runs every row of x against (L2) */
#endif
#ifndef X_CHUNK_BYTES
#define X_CHUNK_BYTES (512 << 10) /* rows of x run against every block in turn */
#endif
#define MIN_PARALLEL_WORK (1 << 16)


/* Which build runs: 0 plain C, 2 AVX-512, 3 AVX2. */
int asyncstep_dense_f32_isa(void) { return F32_ISA; }

#ifndef PREFETCH
#define PREFETCH 0
#endif
#ifndef KEEP_X
#define KEEP_X(v) ((void)0)
#endif

/* sums[e][i] = x row e . W row i for `rows` rows of x and nw rows of W
 * (constants where inlined): one accumulator each along K, LANES at a
 * time in order, the last step's missing k zeros; then every accumulator
 * through vsum8 (unused slots zero). With PREFETCH, W's values `ahead`
 * floats on (0: none) are prefetched, a line at a time (a hint: past W's
 * end it reads nothing). */
static inline __attribute__((always_inline)) void dot_tile_n(
    const float* const* x, const int rows, const float* const* w, const int nw, int64_t K,
    int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    vec acc[ROW_TILE * W_TILE];
    for (int j = 0; j < rows * nw; j++) acc[j] = vzero();
    int64_t k = 0;
    (void)ahead;
    for (; k + LANES <= K; k += LANES) {
        vec wv[W_TILE];
#if PREFETCH
        if (ahead != 0 && k % 16 == 0)
            for (int i = 0; i < nw; i++)
                __builtin_prefetch(w[i] + ahead + k);
#endif
        for (int i = 0; i < nw; i++) wv[i] = vload(w[i] + k);
        for (int i = 0; i < nw; i++) KEEP(wv[i]);
        for (int e = 0; e < rows; e++) {
            vec xv = vload(x[e] + k);
            KEEP_X(xv);
            for (int i = 0; i < nw; i++) acc[e * nw + i] = vfma(wv[i], xv, acc[e * nw + i]);
        }
    }
    if (k < K) {
        const int left = (int)(K - k);
        vec wv[W_TILE];
        for (int i = 0; i < nw; i++) wv[i] = vload_part(w[i] + k, left);
        for (int e = 0; e < rows; e++) {
            const vec xv = vload_part(x[e] + k, left);
            for (int i = 0; i < nw; i++) acc[e * nw + i] = vfma(wv[i], xv, acc[e * nw + i]);
        }
    }
    enum { SLOTS = (ROW_TILE * W_TILE + 7) / 8 * 8 };
    vec lanes[SLOTS];
    float flat[SLOTS];
    const int used = rows * nw, groups = (used + 7) / 8;
    for (int j = 0; j < used; j++) lanes[j] = acc[j];
    for (int j = used; j < groups * 8; j++) lanes[j] = vzero();
    for (int g = 0; g < groups; g++) vsum8(lanes + 8 * g, flat + 8 * g);
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) sums[e][i] = flat[e * nw + i];
}

#ifdef WIDE
/* dot_tile_n's sums with 512-bit accumulators (WIDE): pair p holds rows
 * 2p (low half) and 2p + 1 (high half; a copy of row 2p where rows is odd,
 * its sums dropped); each half then summed as dot_tile_n's (wide_sums). */
static inline __attribute__((always_inline)) void dot_tile_wide(
    const float* const* x, const int rows, const float* const* w, const int nw, int64_t K,
    int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    enum { PAIRS = ROW_TILE / 2 };
    (void)ahead;
    const int pairs = (rows + 1) / 2;
    const float* xs[ROW_TILE];
    for (int e = 0; e < 2 * pairs; e++) xs[e] = x[e < rows ? e : rows - 1];
    __m512 acc[PAIRS * W_TILE];
    for (int j = 0; j < pairs * nw; j++) acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        __m512 wv[W_TILE];
#if PREFETCH
        if (ahead != 0 && k % 16 == 0)
            for (int i = 0; i < nw; i++) __builtin_prefetch(w[i] + ahead + k);
#endif
        for (int i = 0; i < nw; i++) wv[i] = wide_broadcast(vload(w[i] + k));
        for (int i = 0; i < nw; i++) KEEP(wv[i]);
        for (int p = 0; p < pairs; p++) {
            __m512 xv = wide_pair(vload(xs[2 * p] + k), vload(xs[2 * p + 1] + k));
            for (int i = 0; i < nw; i++)
                acc[p * nw + i] = _mm512_fmadd_ps(wv[i], xv, acc[p * nw + i]);
        }
    }
    if (k < K) {
        const int left = (int)(K - k);
        __m512 wv[W_TILE];
        for (int i = 0; i < nw; i++) wv[i] = wide_broadcast(vload_part(w[i] + k, left));
        for (int p = 0; p < pairs; p++) {
            const __m512 xv =
                wide_pair(vload_part(xs[2 * p] + k, left), vload_part(xs[2 * p + 1] + k, left));
            for (int i = 0; i < nw; i++)
                acc[p * nw + i] = _mm512_fmadd_ps(wv[i], xv, acc[p * nw + i]);
        }
    }
    float flat[WIDE_MAX_OUTPUTS];
    wide_sums(acc, rows, nw, flat);
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) sums[e][i] = flat[e * nw + i];
}
#endif

/* dot_tile_n with constant counts (its accumulators in registers). */
static void dot_tile(const float* const* x, int rows, const float* const* w, int nw, int64_t K,
                     int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    switch (nw * 16 + rows) {
#define CASE(NW, ROWS) \
    case NW * 16 + ROWS: dot_tile_n(x, ROWS, w, NW, K, ahead, sums); break;
#ifdef WIDE
#undef CASE
#define CASE(NW, ROWS) \
    case NW * 16 + ROWS: dot_tile_wide(x, ROWS, w, NW, K, ahead, sums); break;
#define CASES(NW) CASE(NW, 1) CASE(NW, 2) CASE(NW, 3) CASE(NW, 4) \
    CASE(NW, 5) CASE(NW, 6) CASE(NW, 7) CASE(NW, 8)
        CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6)
#elif F32_ISA == 3
#define CASES(NW) CASE(NW, 1) CASE(NW, 2) CASE(NW, 3) CASE(NW, 4)
        CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6)
#else
#define CASES(NW) CASE(NW, 1)
        CASES(1)
#endif
#undef CASES
#undef CASE
    }
}

/* sums of the tile at rows r0.. of x (count) and rows n.. of W (nw) into
 * out; W's values `ahead` floats on prefetched (0: none) */
static inline void run_tile(const DenseF32Args* a, int64_t r0, int count, int64_t n, int nw,
                            int64_t ahead) {
    const float* w[W_TILE] = {0};
    const float* x[ROW_TILE] = {0};
    for (int e = 0; e < count; e++) x[e] = a->x + (r0 + e) * a->x_stride;
    for (int i = 0; i < nw; i++) w[i] = a->weight + (n + i) * a->weight_stride;
    float sums[ROW_TILE][W_TILE];
    dot_tile(x, count, w, nw, a->in_features, ahead, sums);
    for (int e = 0; e < count; e++) {
        float* out = a->out + (r0 + e) * a->out_stride + n;
        for (int i = 0; i < nw; i++) out[i] = sums[e][i];
    }
}

/* Rows [c0, end) of x against W's rows [n0, n0 + nb): each tile of x's
 * rows against every tile of the block (x's tile in L1, the block in L2),
 * tiles W_TILE wide (tile_width(count) with TILE_WIDTHS: AVX2); the rows
 * `ahead` rows on (the next block) prefetched as the first tile of x's
 * rows runs (0: none). */
static void run_block(const DenseF32Args* a, int64_t c0, int64_t end, int64_t n0, int64_t nb,
                      int64_t ahead) {
    for (int64_t r0 = c0; r0 < end; r0 += ROW_TILE) {
        const int count = end - r0 < ROW_TILE ? (int)(end - r0) : ROW_TILE;
#ifdef TILE_WIDTHS
        const int w = tile_width(count);
#else
        const int w = W_TILE;
#endif
        for (int64_t i0 = 0; i0 < nb; i0 += w)
            run_tile(a, r0, count, n0 + i0, nb - i0 < w ? (int)(nb - i0) : w,
                     r0 == c0 ? ahead * a->weight_stride : 0);
    }
}

/* out = x @ W.T; 0 on success, -1 when the arguments are out of range
 * (nothing written). */
int asyncstep_dense_f32(const DenseF32Args* a) {
    const int64_t N = a->out_features, K = a->in_features, rows = a->rows;
    if (N < 0 || K < 1 || rows < 0 || a->weight_stride < K || a->x_stride < K ||
        a->out_stride < N)
        return -1;
    if (rows == 0 || N == 0) return 0;
    const int num_threads =
        rows * N * K < MIN_PARALLEL_WORK || a->num_threads < 1 ? 1 : (int)a->num_threads;
    /* blocks of W_GROUP-multiple rows of W (BLOCK_BYTES, at least one per
     * thread), each run against every tile of rows of x, tile after tile of W */
    int64_t block = BLOCK_BYTES / (K * (int64_t)sizeof(float)) / W_GROUP * W_GROUP;
    const int64_t share = (N + num_threads - 1) / num_threads;
    if (block > share) block = (share + W_GROUP - 1) / W_GROUP * W_GROUP;
    if (block < W_GROUP) block = W_GROUP;
    const int64_t blocks = (N + block - 1) / block;
    /* many rows: chunks of x (X_CHUNK_BYTES, L2) each against every block */
    int64_t chunk = X_CHUNK_BYTES / (K * (int64_t)sizeof(float)) / ROW_TILE * ROW_TILE;
    if (chunk < ROW_TILE) chunk = ROW_TILE;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
        const int64_t end = rows - c0 < chunk ? rows : c0 + chunk;
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * block;
            run_block(a, c0, end, n0, N - n0 < block ? N - n0 : block, PREFETCH ? block : 0);
        }
    }
    return 0;
}
