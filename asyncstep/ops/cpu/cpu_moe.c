/*
 * A mixture-of-experts layer's experts on the CPU in one call (built into
 * the library of library.py beside cpu_kernels.c): float32 hidden rows,
 * float32 weights as torch holds them (w13 [E, 2I, H]: each expert's I gate
 * rows then its I up rows; w2 [E, H, I]; contiguous, no copy), int32 expert
 * ids and float32 routing weights [T, k] (the pairs sorted by expert here,
 * stably: torch_moe.sort_by_expert's order); silu(gate) * up between the two
 * matmuls. out[t] = sum over t's pairs, in the order of their experts, of
 * weight * expert(hidden[t]), summed in float32 from 0.
 *
 * No python loop over the experts and no gathered copy of the rows: an
 * item is one expert over its rows (gate/up, act, down, weighted), the
 * items shared by OpenMP threads dynamically (a decode step's ~30 experts
 * of 1 to 4 rows each: one parallel region a layer, no barrier inside it,
 * instead of a parallel matmul per expert), the token sums after the
 * threads join. Each output is
 * one row of x against one row of W along K in one order, into one vector
 * of 8 float32 lanes (k = lane mod 8, one fused multiply-add each), then
 * the lanes summed by cpu_common.h's sum8 tree (halves, then halves again), eight
 * outputs at a time; tiles of rows of x by rows of W share the loads,
 * never the sums, and every slot of a tile gives its output the same tree.
 * Every build has that order (AVX-512 with AVX512VL: 512-bit vectors each
 * holding two rows' 8 lanes, 32 registers, tiles of 8 rows of x by 6 of W,
 * as cpu_dense_f32.c; AVX2 + FMA, 16 registers: 1 by 6, 2 by 4, 3 by 3,
 * 4 by 3 by the tile's rows; plain C: 2 by 4, fmaf; W prefetched ahead in
 * the vector builds): the AVX-512 and AVX2 builds give the same bits
 * (plain C's silu may round apart: no contraction to FMA). Up to
 * STREAM_MAX_ROWS rows an expert's W rows are read in memory's order, in
 * L1 blocks of 12 rows (a decode step streams the weights from DRAM), one
 * row at a time in plain C.
 * So a row's result does not depend on the other rows routed to its
 * experts (the batch: issue 40) nor on the thread count. The silu is
 * x * sigmoid(x) with cpu_common.h's exp (torch's differs by roundings).
 *
 * gpt-oss's experts: biases (w13_bias [E, 2I] added to the gate/up sums,
 * w2_bias [E, H] to the down sums before the routing weight) and the
 * "swigluoai" activation (gate = min(gate, 7), up = clamp(up, -7, 7),
 * (up + 1) * gate * sigmoid(1.702 * gate)). Their weights may stay MXFP4
 * (w13_scales / w2_scales set: w13 and w2 are then uint8 codes): a row of K
 * values is K / 32 blocks of 16 bytes, byte j of a block holding value j in
 * its low nibble and value j + 16 in its high one (GGUF's order; the HF
 * checkpoint's is repacked once at load), and K / 32 E8M0 scale bytes. A
 * vector of LANES values is decoded from its codes (a 16-entry table of the
 * FP4 E2M1 values) times its block's 2^(scale - 127), one float32 multiply:
 * exact (the values have 2 significant bits; 2^-127 is float32's subnormal)
 * unless the product overflows, where it is inf as the dequantized weight
 * is (scale 255 gives inf, and NaN for a zero code, as dequantize_mxfp4
 * does), then enters the same FMA as the dense weight's vector: the packed
 * weights' outputs are the dense kernel's bits on the dequantized weights.
 * bfloat16 weights (bf16_weights: a bfloat16 model's experts, half the
 * bytes a step reads) are widened to float32 as they load (exact) into the
 * same FMAs: the float32 kernel's bits on the widened weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "cpu_f32.h"

#if defined(__AVX512F__) && defined(__AVX512VL__)
#define MOE_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define MOE_ISA 3
#else
#define MOE_ISA 0
#endif

#define LANES 8
#if MOE_ISA == 2 || MOE_ISA == 3
#include <immintrin.h>

#if MOE_ISA == 2
/* 512-bit accumulators, each two 8-lane ones: a pair of rows of x against
 * a row of W (cpu_common.h's wide_pair / wide_broadcast), as
 * cpu_dense_f32.c's; W prefetched ahead */
#define WIDE 1
#define ROW_TILE 8 /* rows of x per tile: 4 pairs */
#define W_TILE 6   /* rows of W per tile: 24 accumulators, 6 of W, 1 of x: 31 of 32 */
#ifndef PREFETCH
#define PREFETCH 1
#endif
/* v held in a register: a tile's W vectors loaded once a step, not folded
 * into each multiply-add as a load of its own (cpu_dense_f32.c's KEEP) */
#define KEEP(v) __asm__("" : "+v"(v))
#else
/* 16 registers: a tile of `rows` rows of x is tile_width(rows) rows of W
 * wide (1 x 6, 2 x 4, 3 x 3, 4 x 3: at most 12 accumulators, their W and
 * one of x), so that 6 to 12 independent multiply-add chains hide the
 * FMA's latency, streamed tiles too */
#define ROW_TILE 4
#define W_TILE 6
#define TILE_WIDTHS 1
/* x's vector too (not folded into each of its 3 multiply-adds as a load) */
#define KEEP_X(v) KEEP(v)
#ifndef PREFETCH
#define PREFETCH 1
#endif
#define KEEP(v) __asm__("" : "+x"(v))
#endif
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
/* eight vectors' lanes summed: cpu_common.h's sum8 network */
static inline __attribute__((always_inline)) void vsum8(const vec v[8], float out[8]) {
    sum8(v, out);
}
/* values [k, k + 8) of a block: 8 bytes (k mod 16 on), the nibble, its
 * magnitude from an 8-entry table, its sign bit set */
static inline vec vload_fp4(const uint8_t* block, int64_t k, float scale) {
    __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(block + (k & 8))));
    if (k & 16) codes = _mm256_srli_epi32(codes, 4);
    const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i magnitude = _mm256_and_si256(codes, _mm256_set1_epi32(7));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
    const vec values = _mm256_xor_ps(_mm256_permutevar8x32_ps(table, magnitude),
                                     _mm256_castsi256_ps(sign));
    return _mm256_mul_ps(values, _mm256_set1_ps(scale));
}
/* 8 bfloat16 values widened to float32 (exact: the high 16 bits) */
static inline vec vload_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
/* Plain C: the library's flags let the compiler reassociate loops of
 * scalars, differently where a tile shape is inlined; GCC is told not to
 * here, every product is an fmaf (the SIMD builds' bits), and the lanes'
 * tree is one function for every output. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-associative-math")
#endif
#define ROW_TILE 2
#define W_TILE 4
#define KEEP(v) ((void)0)
typedef struct { float v[LANES]; } vec;
static inline vec vzero(void) { vec r; memset(&r, 0, sizeof r); return r; }
static inline vec vload(const float* p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vec vfma(vec a, vec b, vec c) {
    for (int i = 0; i < LANES; i++) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
/* cpu_common.h's sum8 tree: (l[i] + l[i + 4]) for i < 4, then (s0 + s2) + (s1 + s3) */
static __attribute__((noinline)) void vsum8(const vec v[8], float out[8]) {
    for (int p = 0; p < 8; p++) {
        float s[4];
        for (int i = 0; i < 4; i++) s[i] = v[p].v[i] + v[p].v[i + 4];
        out[p] = (s[0] + s[2]) + (s[1] + s[3]);
    }
}
static inline vec vload_fp4(const uint8_t* block, int64_t k, float scale) {
    static const float table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    const int shift = k & 16 ? 4 : 0;
    vec r;
    for (int i = 0; i < LANES; i++) r.v[i] = table[(block[(k & 8) + i] >> shift) & 15] * scale;
    return r;
}
static inline vec vload_bf16(const uint16_t* p) {
    vec r;
    for (int i = 0; i < LANES; i++) {
        const uint32_t bits = (uint32_t)p[i] << 16;
        memcpy(&r.v[i], &bits, sizeof bits);
    }
    return r;
}
#endif

/* E8M0: 2^(s - 127) as float32 (s = 0: the subnormal 2^-127; 255: inf). */
static inline float e8m0(uint8_t s) {
    const uint32_t bits = s ? (uint32_t)s << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Up to this many rows an expert's W rows are read one at a time (tiles
 * one row of W wide), in memory's order. */
#ifndef STREAM_MAX_ROWS
#define STREAM_MAX_ROWS 8
#endif


/* The pass's arrays: the pairs sorted by expert, stably (order[p]: the
 * sorted pair's index into the [T * k] pairs; position its inverse). */
typedef struct {
    const MoeArgs* args;
    const int64_t* order;
    float* pair_out;
} Pass;

/* A matrix's rows of K values: float32 (dense), MXFP4 codes and scales, or
 * bfloat16 (half). */
typedef struct {
    const float* dense;
    const uint8_t* codes;
    const uint8_t* scales;
    int64_t K;
    const uint16_t* half;
} Rows;

/* Rows' formats: the `packed` argument of the tiles (a constant where inlined). */
enum { FORMAT_F32 = 0, FORMAT_FP4 = 1, FORMAT_BF16 = 2 };

int asyncstep_moe_lanes(void) { return LANES; }

/* Row i's vector at k: the float32 values, the bfloat16 ones widened, or
 * the MXFP4 codes decoded. */
static inline __attribute__((always_inline)) vec wload(const Rows* w, int64_t i, int64_t k,
                                                       const int packed) {
    if (packed == FORMAT_F32) return vload(w->dense + i * w->K + k);
    if (packed == FORMAT_BF16) return vload_bf16(w->half + i * w->K + k);
    const int64_t block = i * (w->K / 32) + k / 32;
    return vload_fp4(w->codes + block * 16, k, e8m0(w->scales[block]));
}

#ifndef PREFETCH
#define PREFETCH 0
#endif

/* Where row i's values at k lie (float32 or bfloat16 rows: the prefetch's address). */
static inline __attribute__((always_inline)) const void* row_at(const Rows* w, int64_t i,
                                                                int64_t k, const int packed) {
    if (packed == FORMAT_BF16) return w->half + i * w->K + k;
    return w->dense + i * w->K + k;
}
#ifndef KEEP_X
#define KEEP_X(v) ((void)0)
#endif

/* sums[e][i] = x row e . w row (i0 + i) for `rows` rows of x and nw rows of
 * W along K (a multiple of LANES), constants where inlined. With PREFETCH
 * (float32 W), the rows `ahead` rows on are prefetched, a line at a time
 * (a hint: past W's end it reads nothing). */
static inline __attribute__((always_inline)) void dot_tile_n(
    const float* const* x, const int rows, const Rows* w, int64_t i0, const int nw,
    const int packed, int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    const int64_t K = w->K;
    (void)ahead;
    vec acc[ROW_TILE][W_TILE];
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) acc[e][i] = vzero();
#ifdef TILE_WIDTHS /* two steps a turn: the prefetch's test of k folds away */
    _Pragma("GCC unroll 2")
#endif
    for (int64_t k = 0; k < K; k += LANES) {
        vec wv[W_TILE];
#if PREFETCH
        if (packed != FORMAT_FP4 && ahead != 0 && k % (packed == FORMAT_BF16 ? 32 : 16) == 0)
            for (int i = 0; i < nw; i++) /* a line of each row `ahead` rows on */
                __builtin_prefetch(row_at(w, i0 + ahead + i, k, packed));
#endif
        for (int i = 0; i < nw; i++) wv[i] = wload(w, i0 + i, k, packed);
        for (int i = 0; i < nw; i++) KEEP(wv[i]);
        for (int e = 0; e < rows; e++) {
            vec xv = vload(x[e] + k);
            KEEP_X(xv);
            for (int i = 0; i < nw; i++) acc[e][i] = vfma(wv[i], xv, acc[e][i]);
        }
    }
    /* the accumulators eight at a time through vsum8 (unused slots zero) */
    enum { SLOTS = (ROW_TILE * W_TILE + 7) / 8 * 8 };
    vec lanes[SLOTS];
    float flat[SLOTS];
    const int used = rows * nw, groups = (used + 7) / 8;
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) lanes[e * nw + i] = acc[e][i];
    for (int j = used; j < groups * 8; j++) lanes[j] = vzero();
    for (int g = 0; g < groups; g++) vsum8(lanes + 8 * g, flat + 8 * g);
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) sums[e][i] = flat[e * nw + i];
}

#ifdef WIDE
/* dot_tile_n's sums with 512-bit accumulators: pair p holds rows 2p (low
 * half) and 2p + 1 (high half; a copy of row 2p where rows is odd, its
 * sums dropped); each half then summed as dot_tile_n's (wide_sums). */
static inline __attribute__((always_inline)) void dot_tile_wide(
    const float* const* x, const int rows, const Rows* w, int64_t i0, const int nw,
    const int packed, int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    enum { PAIRS = ROW_TILE / 2 };
    const int64_t K = w->K;
    (void)ahead;
    const int pairs = (rows + 1) / 2;
    const float* xs[ROW_TILE];
    for (int e = 0; e < 2 * pairs; e++) xs[e] = x[e < rows ? e : rows - 1];
    __m512 acc[PAIRS * W_TILE];
    for (int p = 0; p < pairs; p++)
        for (int i = 0; i < nw; i++) acc[p * nw + i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += LANES) {
        __m512 wv[W_TILE];
#if PREFETCH
        if (packed != FORMAT_FP4 && ahead != 0 && k % (packed == FORMAT_BF16 ? 32 : 16) == 0)
            for (int i = 0; i < nw; i++) /* a line of each row `ahead` rows on */
                __builtin_prefetch(row_at(w, i0 + ahead + i, k, packed));
#endif
        for (int i = 0; i < nw; i++) wv[i] = wide_broadcast(wload(w, i0 + i, k, packed));
        for (int i = 0; i < nw; i++) KEEP(wv[i]);
        for (int p = 0; p < pairs; p++) {
            const __m512 xv = wide_pair(vload(xs[2 * p] + k), vload(xs[2 * p + 1] + k));
            for (int i = 0; i < nw; i++)
                acc[p * nw + i] = _mm512_fmadd_ps(wv[i], xv, acc[p * nw + i]);
        }
    }
    float flat[WIDE_MAX_OUTPUTS];
    wide_sums(acc, rows, nw, flat);
    for (int e = 0; e < rows; e++)
        for (int i = 0; i < nw; i++) sums[e][i] = flat[e * nw + i];
}
#define TILE_FN dot_tile_wide
#else
#define TILE_FN dot_tile_n
#endif

#if ROW_TILE == 8
#define CASES(NW, P) CASE(NW, 1, P) CASE(NW, 2, P) CASE(NW, 3, P) CASE(NW, 4, P) \
    CASE(NW, 5, P) CASE(NW, 6, P) CASE(NW, 7, P) CASE(NW, 8, P)
#elif ROW_TILE == 4
#define CASES(NW, P) CASE(NW, 1, P) CASE(NW, 2, P) CASE(NW, 3, P) CASE(NW, 4, P)
#else
#define CASES(NW, P) CASE(NW, 1, P) CASE(NW, 2, P)
#endif
#if W_TILE == 6
#define ALL_CASES(P) CASES(1, P) CASES(2, P) CASES(3, P) CASES(4, P) CASES(5, P) CASES(6, P)
#else
#define ALL_CASES(P) CASES(1, P) CASES(2, P) CASES(3, P) CASES(4, P)
#endif
#define CASE(NW, ROWS, P) \
    case NW * 16 + ROWS: TILE_FN(x, ROWS, w, i0, NW, P, ahead, sums); break;

static void dot_tile(const float* const* x, int rows, const Rows* w, int64_t i0, int nw,
                     int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    switch (nw * 16 + rows) { ALL_CASES(0) }
}

static void dot_tile_fp4(const float* const* x, int rows, const Rows* w, int64_t i0, int nw,
                         int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    switch (nw * 16 + rows) { ALL_CASES(1) }
}

static void dot_tile_bf16(const float* const* x, int rows, const Rows* w, int64_t i0, int nw,
                          int64_t ahead, float sums[ROW_TILE][W_TILE]) {
    switch (nw * 16 + rows) { ALL_CASES(2) }
}
#undef CASE
#undef ALL_CASES
#undef CASES
#undef TILE_FN

/* Rows of W a block holds (more rows than STREAM_MAX_ROWS). In plain C its
 * first tile of x's rows takes it a row of W at a time (fetched in memory's
 * order, one stream), the later tiles in tiles W_TILE wide from L2. Where
 * TILE_WIDTHS (AVX2), every tile is tile_width(rows) wide, the first too;
 * with WIDE (AVX-512), W_TILE wide. In both, up to STREAM_MAX_ROWS rows W is
 * read in blocks of STREAM_BLOCK rows (L1), every tile of x's rows against
 * each. */
#ifndef BLOCK_ROWS
#define BLOCK_ROWS 48
#endif
#ifdef TILE_WIDTHS
#ifndef STREAM_BLOCK
#define STREAM_BLOCK 12
#endif
#ifndef STREAM_AHEAD
#define STREAM_AHEAD 12
#endif
static inline int tile_width(int rows) { return rows == 1 ? 6 : rows == 2 ? 4 : 3; }
#define FETCH_WIDTH(rows) tile_width(rows)
#define STREAM_WIDTH(rows) tile_width(rows)
#define TILE_WIDTH(rows) tile_width(rows)
#elif defined(WIDE)
#ifndef STREAM_BLOCK
#define STREAM_BLOCK 12
#endif
#ifndef STREAM_AHEAD
#define STREAM_AHEAD 12
#endif
#define FETCH_WIDTH(rows) W_TILE
#define STREAM_WIDTH(rows) W_TILE
#define TILE_WIDTH(rows) W_TILE
#else
#define STREAM_BLOCK 1
#define STREAM_AHEAD 0
#define FETCH_WIDTH(rows) 1
#define STREAM_WIDTH(rows) 1
#define TILE_WIDTH(rows) W_TILE
#endif

/* out[r * out_stride + i] = x[r] . w[i] for x's rows [r0, r0 + count) and
 * W's rows [i0, i0 + nw), tiles `width` rows of W wide, the rows `ahead`
 * rows on prefetched. */
static void matmul_tiles(const float* const* x, int64_t r0, int count, const Rows* w,
                         int64_t i0, int64_t nw, int width, int64_t ahead, float* out,
                         int64_t out_stride) {
    for (int64_t i = i0; i < i0 + nw; i += width) {
        const int n = i0 + nw - i < width ? (int)(i0 + nw - i) : width;
        float sums[ROW_TILE][W_TILE];
        if (w->codes != NULL)
            dot_tile_fp4(x + r0, count, w, i, n, ahead, sums);
        else if (w->half != NULL)
            dot_tile_bf16(x + r0, count, w, i, n, ahead, sums);
        else
            dot_tile(x + r0, count, w, i, n, ahead, sums);
        for (int e = 0; e < count; e++)
            for (int j = 0; j < n; j++) out[(r0 + e) * out_stride + i + j] = sums[e][j];
    }
}

/* out[e * out_stride + i] = x[e] . w[i] for `rows` rows of x and nw rows of
 * W: up to STREAM_MAX_ROWS rows, W in blocks of STREAM_BLOCK rows (one
 * with AVX-512), every tile of x's rows against each (W read once, in
 * memory's order); more, W in blocks of BLOCK_ROWS, every tile of x's rows
 * against each. Where PREFETCH (AVX2, AVX-512), every tile prefetches the
 * rows STREAM_AHEAD or BLOCK_ROWS on. */
static void matmul_rows(const float* const* x, int64_t rows, const Rows* w, int64_t nw,
                        float* out, int64_t out_stride) {
    const int stream = rows <= STREAM_MAX_ROWS;
    const int64_t block = stream ? STREAM_BLOCK : BLOCK_ROWS;
    for (int64_t b0 = 0; b0 < nw; b0 += block) {
        const int64_t nb = nw - b0 < block ? nw - b0 : block;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int count = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            const int width = stream ? STREAM_WIDTH(count)
                              : r0 == 0 ? FETCH_WIDTH(count)
                                        : TILE_WIDTH(count);
            const int64_t ahead = stream ? STREAM_AHEAD : BLOCK_ROWS;
            matmul_tiles(x, r0, count, w, b0, nb, width, ahead, out, out_stride);
        }
    }
}

/* silu(g) * u: g * sigmoid(g) * u, sigmoid from exp(-|g|) (no overflow). */
static inline float sigmoid(float g) {
    const float e = exp_nonpositive(g < 0 ? g : -g);
    return g < 0 ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

static inline float silu_mul(float g, float u) { return g * sigmoid(g) * u; }

/* gpt-oss's swigluoai: (clamp(u, -7, 7) + 1) * (g' * sigmoid(1.702 g')), g' = min(g, 7). */
static inline float swigluoai(float g, float u) {
    g = g > 7.0f ? 7.0f : g;
    u = u > 7.0f ? 7.0f : (u < -7.0f ? -7.0f : u);
    return (u + 1.0f) * (g * sigmoid(g * 1.702f));
}

typedef struct {
    int64_t expert, start, count; /* the expert's sorted pairs [start, start + count) */
} Group;

/* Expert e's rows of a [E, rows, K] matrix (float32, bfloat16 where bf16,
 * or MXFP4 where scales). */
static Rows expert_rows(const void* base, const uint8_t* scales, int64_t bf16, int64_t e,
                        int64_t rows, int64_t K) {
    if (bf16) return (Rows){NULL, NULL, NULL, K, (const uint16_t*)base + e * rows * K};
    if (scales == NULL) return (Rows){(const float*)base + e * rows * K, NULL, NULL, K, NULL};
    return (Rows){NULL, (const uint8_t*)base + e * rows * (K / 2), scales + e * rows * (K / 32),
                  K, NULL};
}

/* One expert over its pairs: the gate and up rows (and bias), their act,
 * the down rows (and bias), each pair's output weighted (x: room for its
 * rows' pointers; work: for its rows' gate/up and act, [count, 3I], the
 * thread's, reused item after item). */
static void expert_item(const Pass* pass, const Group* g, const float** x, float* work) {
    const MoeArgs* a = pass->args;
    const int64_t H = a->hidden_size, I = a->inter, e = g->expert;
    for (int64_t r = 0; r < g->count; r++)
        x[r] = a->hidden + (pass->order[g->start + r] / a->top_k) * a->hidden_stride;
    const Rows w13 = expert_rows(a->w13, a->w13_scales, a->bf16_weights, e, 2 * I, H);
    float* gu = work;
    matmul_rows(x, g->count, &w13, 2 * I, gu, 2 * I);
    const float* b13 = a->w13_bias == NULL ? NULL : a->w13_bias + e * 2 * I;
    for (int64_t r = 0; r < g->count; r++) {
        float* row = gu + r * 2 * I;
        if (b13 != NULL)
            for (int64_t i = 0; i < 2 * I; i++) row[i] = row[i] + b13[i];
        float* act = work + g->count * 2 * I + r * I;
        if (a->activation == 1)
            for (int64_t i = 0; i < I; i++) act[i] = swigluoai(row[i], row[I + i]);
        else
            for (int64_t i = 0; i < I; i++) act[i] = silu_mul(row[i], row[I + i]);
        x[r] = act;
    }
    const Rows w2 = expert_rows(a->w2, a->w2_scales, a->bf16_weights, e, H, I);
    float* po = pass->pair_out + g->start * H;
    matmul_rows(x, g->count, &w2, H, po, H);
    const float* b2 = a->w2_bias == NULL ? NULL : a->w2_bias + e * H;
    for (int64_t r = 0; r < g->count; r++) {
        const float weight = a->topk_weights[pass->order[g->start + r]];
        float* row = po + r * H;
        if (b2 != NULL)
            for (int64_t h = 0; h < H; h++) row[h] = (row[h] + b2[h]) * weight;
        else
            for (int64_t h = 0; h < H; h++) row[h] = row[h] * weight;
    }
}

/* out[t] = its pairs' weighted outputs summed from 0 in sorted order (the
 * order of their experts). */
static void token_sum(const MoeArgs* a, const float* pair_out, const int64_t* position,
                      int64_t t) {
    const int64_t H = a->hidden_size, k = a->top_k;
    int64_t at[64];
    for (int64_t j = 0; j < k; j++) { /* insertion sort of t's sorted positions */
        int64_t p = position[t * k + j], m = j;
        for (; m > 0 && at[m - 1] > p; m--) at[m] = at[m - 1];
        at[m] = p;
    }
    float* out = a->out + t * H;
    for (int64_t h = 0; h < H; h++) out[h] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const float* po = pair_out + at[j] * H;
        for (int64_t h = 0; h < H; h++) out[h] = out[h] + po[h];
    }
}

/* The experts' weighted sums into out; 0 on success, -1 when the shapes
 * are out of range (K not whole vectors, or not whole MXFP4 blocks, top_k
 * > 64, one of two scales, an unknown activation) or scratch memory
 * cannot be had, -2 when an expert id is not in [0, E) (nothing written). */
int asyncstep_moe_experts(const MoeArgs* a) {
    const int64_t E = a->num_experts, H = a->hidden_size, I = a->inter;
    const int64_t T = a->num_tokens, k = a->top_k, P = T * k;
    if (E < 1 || H < 1 || I < 1 || H % LANES || I % LANES || k < 1 || k > 64 || T < 0) return -1;
    if ((a->w13_scales != NULL) != (a->w2_scales != NULL)) return -1;
    if (a->w13_scales != NULL && (H % 32 || I % 32)) return -1;
    if (a->bf16_weights != 0 && (a->bf16_weights != 1 || a->w13_scales != NULL)) return -1;
    if (a->activation != 0 && a->activation != 1) return -1;
    for (int64_t f = 0; f < P; f++)
        if (a->topk_ids[f] < 0 || a->topk_ids[f] >= E) return -2;
    if (T == 0) return 0;
    Group* groups = malloc(sizeof(Group) * (size_t)E);
    int64_t* counts = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t* order = malloc(sizeof(int64_t) * (size_t)P);
    int64_t* position = malloc(sizeof(int64_t) * (size_t)P);
    if (groups == NULL || counts == NULL || order == NULL || position == NULL) {
        free(groups);
        free(counts);
        free(order);
        free(position);
        return -1;
    }
    /* counting sort by expert, stable: counts[e + 1] pairs of expert e, then
     * their starts, then each pair placed in the pairs' order */
    for (int64_t f = 0; f < P; f++) counts[a->topk_ids[f] + 1]++;
    int64_t used = 0, most = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t c = counts[e + 1];
        if (c > 0) groups[used++] = (Group){e, counts[e], c};
        if (c > most) most = c;
        counts[e + 1] += counts[e];
    }
    for (int64_t f = 0; f < P; f++) {
        const int64_t p = counts[a->topk_ids[f]]++;
        order[p] = f;
        position[f] = p;
    }
    const Pass pass = {a, order, a->scratch};
    const int num_threads = a->num_threads > 1 ? (int)a->num_threads : 1;
    int failed = 0;
    /* one item an expert (no barrier between its matmuls), the token sums
     * after the threads join */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && used > 1)
    {
        const float** x = malloc(sizeof(*x) * (size_t)most);
        float* work = malloc(sizeof(float) * (size_t)(most * 3 * I));
        const int ok = x != NULL && work != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t j = 0; j < used; j++)
            if (ok) expert_item(&pass, &groups[j], x, work);
        free(x);
        free(work);
    }
    if (!failed)
        for (int64_t t = 0; t < T; t++) token_sum(a, pass.pair_out, position, t);
    free(groups);
    free(counts);
    free(order);
    free(position);
    return failed ? -1 : 0;
}
