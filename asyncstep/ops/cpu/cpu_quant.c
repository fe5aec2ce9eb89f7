/*
 * Weight-only quantized matmuls for CPU steps of any size (built into the library
 * of library.py beside cpu_kernels.c): out = x @ W.T for rows of x and out
 * (each float32 or bfloat16) and W [N, K] kept in GGUF's blocks of 32 input
 * features, every weight w = d * q + m with a float16 scale d and offset m
 * per block (Q4_1: 4-bit q and its own m; Q4_0: m = -8 d; Q8_0: 8-bit
 * q + 128, m = -128 d).
 *
 * x is quantized per row and block of 32 to int8 codes with a float32 scale
 * (nearest even, as llama.cpp's Q8_1 activations), so a block's dot product
 * is d_w * d_x * sum(q_w * q_x) + m_w * d_x * sum(q_x): integer products of
 * unsigned weight codes and signed activation codes (AVX512-VNNI's
 * vpdpbusd, 64 a instruction), then two float32 multiply-adds a block.
 * With two levels (asyncstep_q_quantize_block) the second code is the
 * remainder's at 1/256 of the first scale, so a value's codes are one 16-bit
 * code 256 q1 + q2 at scale d2: the two integer sums combine exactly
 * (256 s1 + s2, in int32) and the block still costs two float32
 * multiply-adds, not four.
 *
 * Layout: 16 output rows are interleaved so that one vector holds one
 * partial sum per row. W is [ceil(N / 16), K / 32, BLOCK_BYTES]: for each
 * group of 16 rows and each block, the codes, then the 16 scales d, then
 * the 16 offsets m (float16). Codes: eight 64-byte vectors j = 0..7, lane r
 * (row 16 g + r), byte i holding the code of input feature 4 j + i. Q8:
 * those 512 bytes. Q4: 256 bytes, vector c = 0..3 holding vector c's codes
 * in its low nibbles and vector c + 4's in its high nibbles. Rows past N
 * are zero (scale and offset 0).
 *
 * Rows of x are taken QTILE_ROWS at a time: a block's codes, unpacked
 * once, serve every row of the tile. Many rows are taken in chunks (about
 * QCHUNK_BYTES of their codes, kept in L2 while every group of 16 outputs
 * passes over them); within a chunk the groups are spread over OpenMP
 * threads. Each output is one tile's sums over the blocks in order,
 * whatever the tile, chunk or thread: a row's results do not depend on the
 * other rows or the thread count. On AVX2 (with FMA and F16C) the same
 * arithmetic runs 8 output rows at a time, two levels as one 16-bit code
 * with vpmaddwd (one level: vpmaddubsw), and elsewhere in plain C
 * (both exact: integer sums, then the same float32 operations in the same
 * order); asyncstep_qmatmul_fast() says which build runs (QMATMUL_ISA_*).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "cpu_quant.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QMATMUL_ISA QMATMUL_ISA_VNNI
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QMATMUL_ISA QMATMUL_ISA_AVX2
#include <immintrin.h>
#else
#define QMATMUL_ISA QMATMUL_ISA_PLAIN
#endif

/* Rows of x per pass over a group's weights (one level, two): the AVX-512
 * build keeps 12 accumulators in its 32 vector registers (a block's codes,
 * unpacked once, serve 12 rows; 16 spill), the AVX2 build 8 (chosen with
 * two levels among 4, 6 and 8: benchmarks/results/cpu/avx2_words_1206/). */
#if QMATMUL_ISA == QMATMUL_ISA_VNNI
#define QTILE_ROWS_1 12
#define QTILE_ROWS_2 12
#define QTILE_ROWS_MAX 12
#else
#define QTILE_ROWS_1 8
#define QTILE_ROWS_2 8
#define QTILE_ROWS_MAX 8
#endif

/* Multiply-adds below which a call runs on one thread. */
#define QMIN_PARALLEL_WORK (1 << 16)

static inline int64_t code_bytes(int64_t kind) { return kind == QKIND_Q4 ? 256 : 512; }
static inline int64_t block_bytes(int64_t kind) { return code_bytes(kind) + 4 * QGROUP; }

int asyncstep_qmatmul_fast(void) { return QMATMUL_ISA; }
int asyncstep_qmatmul_block_bytes(int kind) { return (int)block_bytes(kind); }

/* Arguments as one struct (8-byte fields): ctypes converts each argument of
 * a call separately, a cost a one-token step pays per call. */
typedef struct {
    int64_t kind;
    const uint8_t* weight;
    int64_t out_features, in_features;
    int64_t dtype; /* of x */
    const void* x;
    int64_t x_stride;
    void* out;
    int64_t out_stride;
    int64_t out_dtype;
    int64_t rows;
    int64_t levels; /* 1 or 2: activation codes per value (asyncstep_q_quantize_block) */
    int64_t num_threads;
} QMatmulArgs;

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                   mant = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        c.f = (float)mant * 5.9604644775390625e-8f;
        c.u |= sign;
    } else if (exp == 31) {
        c.u = sign | 0x7f800000u | (mant << 13);
    } else {
        c.u = sign | ((exp + 112) << 23) | (mant << 13);
    }
    return c.f;
}

static inline float load_x(const void* x, int64_t dtype, int64_t i) {
    return dtype == QDTYPE_BFLOAT16 ? bf16_to_f32(((const bf16_t*)x)[i]) : ((const float*)x)[i];
}

static inline void store_out(void* out, int64_t dtype, int64_t i, float v) {
    if (dtype == QDTYPE_BFLOAT16)
        ((bf16_t*)out)[i] = f32_to_bf16(v);
    else
        ((float*)out)[i] = v;
}

/* One block of 32 values as int8 codes (nearest even) with the scale
 * d1 = max|v| / 127; with two levels, the remainder r = v - d1 q1 (one
 * rounding: a fused multiply-add; |r| <= d1 / 2) again, with the scale
 * d2 = d1 / 256 and codes clamped to +-127: v ~ d2 (256 q1 + q2), one
 * 16-bit code a value (QLEVEL_SHIFT). d holds d1, then d2 (the scale the
 * matmul applies); s is d2 * (256 sum(q1) + sum(q2)) (one level: d1 sum(q1)).
 * The AVX-512 build computes the same values 16 at a time. */
#define QLEVEL_SHIFT 8
#if QMATMUL_ISA == QMATMUL_ISA_VNNI
static inline __attribute__((always_inline)) __m512i block_codes(__m512 v, float inv, int clamp) {
    __m512 c = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (clamp) c = _mm512_min_ps(_mm512_max_ps(c, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    return _mm512_cvtps_epi32(c);
}

void asyncstep_q_quantize_block(const float* values, int64_t row, int64_t block,
                                const QuantizedRows* out) {
    const int64_t K = out->in_features, blocks = K / QBLOCK, levels = out->levels;
    __m512 v0 = _mm512_loadu_ps(values), v1 = _mm512_loadu_ps(values + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float scale = amax * (1.0f / 127.0f); /* what -freciprocal-math makes of amax / 127 */
    int32_t sum = 0;
    for (int64_t level = 0; level < levels; level++) {
        if (level > 0) scale = scale * (1.0f / (1 << QLEVEL_SHIFT));
        const float inv = scale == 0.0f ? 0.0f : level == 0 ? 127.0f / amax : 1.0f / scale;
        const int64_t entry = row * levels + level;
        int8_t* codes = out->q + entry * K + block * QBLOCK;
        const __m512i i0 = block_codes(v0, inv, level > 0), i1 = block_codes(v1, inv, level > 0);
        _mm_storeu_si128((__m128i*)codes, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i*)(codes + 16), _mm512_cvtepi32_epi8(i1));
        sum = sum * (1 << QLEVEL_SHIFT) + _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        if (level == 0 && levels > 1) {
            v0 = _mm512_fnmadd_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(i0), v0);
            v1 = _mm512_fnmadd_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(i1), v1);
        }
        out->d[entry * blocks + block] = scale;
    }
    out->s[row * blocks + block] = scale * (float)sum;
}
#else
#if QMATMUL_ISA == QMATMUL_ISA_AVX2
/* Row `row`'s block `block` of two levels as 16-bit codes c = 256 q1 + q2,
 * paired for vpmaddwd against a weight vector's 16-bit lanes: a weight
 * vector j holds, for each output, input features 4 j .. 4 j + 3; its even
 * 16-bit lanes take features 4 j and 4 j + 2 (pair j: c[4 j], c[4 j + 2]),
 * its odd lanes 4 j + 1 and 4 j + 3 (pair 8 + j). */
static inline void pair_codes(const QuantizedRows* out, int64_t row, int64_t block) {
    const int64_t K = out->in_features;
    const int8_t* q1 = out->q + 2 * row * K + block * QBLOCK;
    const int8_t* q2 = q1 + K;
    int16_t* c = out->c + row * K + block * QBLOCK;
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 4; i++) {
            const int k = 4 * j + i;
            c[16 * (i % 2) + 2 * j + i / 2] = (int16_t)(q1[k] * (1 << QLEVEL_SHIFT) + q2[k]);
        }
}
#endif

void asyncstep_q_quantize_block(const float* values, int64_t row, int64_t block,
                                const QuantizedRows* out) {
    const int64_t K = out->in_features, blocks = K / QBLOCK, levels = out->levels;
    float v[QBLOCK];
    memcpy(v, values, sizeof(v));
    float amax = 0.0f;
    for (int i = 0; i < QBLOCK; i++) {
        const float a = v[i] < 0 ? -v[i] : v[i];
        amax = a > amax ? a : amax;
    }
    float scale = amax * (1.0f / 127.0f); /* what -freciprocal-math makes of amax / 127 */
    int32_t sum = 0;
    for (int64_t level = 0; level < levels; level++) {
        if (level > 0) scale = scale * (1.0f / (1 << QLEVEL_SHIFT));
        const float inv = scale == 0.0f ? 0.0f : level == 0 ? 127.0f / amax : 1.0f / scale;
        const int64_t entry = row * levels + level;
        int8_t* codes = out->q + entry * K + block * QBLOCK;
        int32_t level_sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            float c = __builtin_rintf(v[i] * inv);
            if (level > 0) c = c < -127.0f ? -127.0f : (c > 127.0f ? 127.0f : c);
            codes[i] = (int8_t)(int32_t)c;
            level_sum += (int32_t)c;
            if (level == 0 && levels > 1) v[i] = __builtin_fmaf(-scale, c, v[i]);
        }
        sum = sum * (1 << QLEVEL_SHIFT) + level_sum;
        out->d[entry * blocks + block] = scale;
    }
    out->s[row * blocks + block] = scale * (float)sum;
#if QMATMUL_ISA == QMATMUL_ISA_AVX2
    if (levels == 2) pair_codes(out, row, block);
#endif
}
#endif

void asyncstep_q_quantize(const void* x, int64_t dtype, int64_t x_stride, int64_t rows,
                          const QuantizedRows* out) {
    const int64_t blocks = out->in_features / QBLOCK;
#pragma omp for schedule(static)
    for (int64_t at = 0; at < rows * blocks; at++) {
        const int64_t row = at / blocks, b = at % blocks;
        float v[QBLOCK];
        for (int i = 0; i < QBLOCK; i++) v[i] = load_x(x, dtype, row * x_stride + b * QBLOCK + i);
        asyncstep_q_quantize_block(v, row, b, out);
    }
}

#if QMATMUL_ISA == QMATMUL_ISA_VNNI
/* Codes of one block as eight vectors of unsigned bytes (see the layout). */
static inline __attribute__((always_inline)) void unpack_codes(const uint8_t* p, int64_t kind,
                                                               __m512i v[8]) {
    if (kind == QKIND_Q4) {
        const __m512i low = _mm512_set1_epi8(0x0f);
        for (int c = 0; c < 4; c++) {
            const __m512i packed = _mm512_loadu_si512(p + 64 * c);
            v[c] = _mm512_and_si512(packed, low);
            v[c + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
    } else {
        for (int j = 0; j < 8; j++) v[j] = _mm512_loadu_si512(p + 64 * j);
    }
}

/* Sum over one level of row t's codes of block b: sum(q_w * q_x). */
static inline __attribute__((always_inline)) __m512i block_dot(const __m512i v[8],
                                                               const int8_t* codes) {
    const int32_t* a = (const int32_t*)codes;
    __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(a[0]));
    __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[1], _mm512_set1_epi32(a[1]));
    s0 = _mm512_dpbusd_epi32(s0, v[2], _mm512_set1_epi32(a[2]));
    s1 = _mm512_dpbusd_epi32(s1, v[3], _mm512_set1_epi32(a[3]));
    s0 = _mm512_dpbusd_epi32(s0, v[4], _mm512_set1_epi32(a[4]));
    s1 = _mm512_dpbusd_epi32(s1, v[5], _mm512_set1_epi32(a[5]));
    s0 = _mm512_dpbusd_epi32(s0, v[6], _mm512_set1_epi32(a[6]));
    s1 = _mm512_dpbusd_epi32(s1, v[7], _mm512_set1_epi32(a[7]));
    return _mm512_add_epi32(s0, s1);
}

/* Partial sums of one group for `rows` (<= QTILE_ROWS) rows of x, `levels`
 * code entries a row (both constants once inlined): out[t * 16 + r]. With
 * two levels a block's integer sums combine as 256 sum(q_w q1) + sum(q_w q2)
 * (exact in int32) before the one float32 multiply-add by d_w d2. */
static inline __attribute__((always_inline)) void group_tile(
    const uint8_t* w, int64_t kind, int64_t blocks, const QuantizedRows* x, int64_t K,
    float* out, const int rows, const int levels) {
    __m512 acc[QTILE_ROWS_MAX];
    for (int t = 0; t < rows; t++) acc[t] = _mm512_setzero_ps();
    const int64_t bytes = block_bytes(kind), codes = code_bytes(kind);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* p = w + b * bytes;
        __m512i v[8];
        unpack_codes(p, kind, v);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + codes)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + codes + 32)));
        for (int t = 0; t < rows; t++) {
            const int8_t* q = x->q + t * levels * K + b * QBLOCK;
            __m512i dot = block_dot(v, q);
            if (levels == 2)
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, QLEVEL_SHIFT), block_dot(v, q + K));
            const __m512 scale =
                _mm512_mul_ps(dw, _mm512_set1_ps(x->d[(t * levels + levels - 1) * blocks + b]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t]);
            acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x->s[t * blocks + b]), acc[t]);
        }
    }
    for (int t = 0; t < rows; t++) _mm512_storeu_ps(out + t * QGROUP, acc[t]);
}
#elif QMATMUL_ISA == QMATMUL_ISA_AVX2
/* Half h of a block's codes (rows 8 h .. 8 h + 7) as eight vectors of bytes:
 * Q4's codes as they are (0..15), Q8's less 128 (signed). */
static inline __attribute__((always_inline)) void unpack_half(const uint8_t* p, int64_t kind,
                                                              int h, __m256i v[8]) {
    if (kind == QKIND_Q4) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (int c = 0; c < 4; c++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i*)(p + 64 * c + 32 * h));
            v[c] = _mm256_and_si256(packed, low);
            v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        }
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int j = 0; j < 8; j++)
            v[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 64 * j + 32 * h)), flip);
    }
}

/* sum(q_w * q_x) of one level of a row's codes for 8 weight rows, exact.
 * vpmaddubsw multiplies unsigned by signed bytes into pairs of int16 with
 * saturation: Q4's pairs (|.| <= 2 * 15 * 127) add up in int16 over the
 * whole block (<= 30480); Q8's signed codes go in as |q| with x's sign
 * moved over (pairs <= 2 * 128 * 127), widened at once, and the 128 taken
 * off the codes is added back as 128 * sum(q_x). */
static inline __attribute__((always_inline)) __m256i half_dot(const __m256i v[8],
                                                              const int8_t* codes,
                                                              int64_t kind) {
    int32_t a[8];
    memcpy(a, codes, sizeof(a));
    const __m256i ones = _mm256_set1_epi16(1);
    if (kind == QKIND_Q4) {
        __m256i s = _mm256_maddubs_epi16(v[0], _mm256_set1_epi32(a[0]));
        for (int j = 1; j < 8; j++)
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[j], _mm256_set1_epi32(a[j])));
        return _mm256_madd_epi16(s, ones);
    }
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(a[j]), v[j]);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(v[j], v[j]), x);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));
    }
    int32_t sum = 0;
    for (int k = 0; k < QBLOCK; k++) sum += codes[k];
    return _mm256_add_epi32(s, _mm256_set1_epi32(128 * sum));
}

/* Weight vector j's codes (its 8 outputs' input features 4 j .. 4 j + 3)
 * widened to 16 bits: features 4 j and 4 j + 2 in *even, 4 j + 1 and
 * 4 j + 3 in *odd (Q4 0..15, Q8 0..255, unsigned: the 128 stays in). */
static inline __attribute__((always_inline)) void unpack_words(const uint8_t* p, int64_t kind,
                                                               int h, int j, __m256i* even,
                                                               __m256i* odd) {
    if (kind == QKIND_Q4) {
        const __m256i nibble = _mm256_set1_epi16(0x000f);
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(p + 64 * (j % 4) + 32 * h));
        const int shift = j < 4 ? 0 : 4;
        *even = _mm256_and_si256(_mm256_srli_epi16(packed, shift), nibble);
        *odd = _mm256_and_si256(_mm256_srli_epi16(packed, 8 + shift), nibble);
    } else {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * j + 32 * h));
        *even = _mm256_and_si256(v, _mm256_set1_epi16(0x00ff));
        *odd = _mm256_srli_epi16(v, 8);
    }
}

/* Blocks ahead (Q4, Q8) that a group's first pass asks the memory for (its
 * second pass, on cached codes, asks for the next group's): with the
 * hardware's prefetcher alone a few-row step waited on memory, reading its
 * weights at about half the two cores' bandwidth
 * (benchmarks/results/cpu/avx2_prefetch_1206/). */
#ifndef QPREFETCH_Q4
#define QPREFETCH_Q4 16
#endif
#ifndef QPREFETCH_Q8
#define QPREFETCH_Q8 8
#endif
/* Two levels, 8 rows (half a group) at a time: a block's sum(q_w * c) with
 * c = 256 q1 + q2 (QuantizedRows.c) by vpmaddwd, the integer that the
 * VNNI build makes of its two sums (|.| <= 32 * 255 * 32639 < 2^31:
 * exact), then the same float32 operations in the same order. Half the
 * multiplies of two vpmaddubsw levels, and Q8 without their sign tricks. */
static inline __attribute__((always_inline)) void group_tile_words_of(
    const uint8_t* w, const int64_t kind, int64_t blocks, const QuantizedRows* x, int64_t K,
    float* out, const int rows) {
    const int64_t bytes = block_bytes(kind), codes = code_bytes(kind);
    const int64_t ahead = (kind == QKIND_Q4 ? QPREFETCH_Q4 : QPREFETCH_Q8) * bytes;
    for (int h = 0; h < 2; h++) {
        __m256 acc[QTILE_ROWS_MAX];
        for (int t = 0; t < rows; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* p = w + b * bytes;
            /* The first pass: blocks ahead; the second (in the cache): the
             * next group's block b, which that group's first pass reads. */
            const uint8_t* next = p + (h == 0 ? ahead : blocks * bytes);
            for (int64_t line = 0; line < bytes; line += 64)
                _mm_prefetch((const char*)(next + line), _MM_HINT_T0);
            __m256i dot[QTILE_ROWS_MAX];
            for (int t = 0; t < rows; t++) dot[t] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i even, odd;
                unpack_words(p, kind, h, j, &even, &odd);
                for (int t = 0; t < rows; t++) {
                    const int32_t* pairs = (const int32_t*)(x->c + t * K + b * QBLOCK);
                    dot[t] = _mm256_add_epi32(
                        dot[t], _mm256_madd_epi16(even, _mm256_set1_epi32(pairs[j])));
                    dot[t] = _mm256_add_epi32(
                        dot[t], _mm256_madd_epi16(odd, _mm256_set1_epi32(pairs[8 + j])));
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + codes + 16 * h)));
            const __m256 mw =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + codes + 32 + 16 * h)));
            for (int t = 0; t < rows; t++) {
                const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x->d[(t * 2 + 1) * blocks + b]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), scale, acc[t]);
                acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->s[t * blocks + b]), acc[t]);
            }
        }
        for (int t = 0; t < rows; t++) _mm256_storeu_ps(out + t * QGROUP + 8 * h, acc[t]);
    }
}

/* group_tile_words_of with the weight kind a constant in each copy. */
static inline __attribute__((always_inline)) void group_tile_words(
    const uint8_t* w, int64_t kind, int64_t blocks, const QuantizedRows* x, int64_t K,
    float* out, const int rows) {
    if (kind == QKIND_Q4)
        group_tile_words_of(w, QKIND_Q4, blocks, x, K, out, rows);
    else
        group_tile_words_of(w, QKIND_Q8, blocks, x, K, out, rows);
}

/* As the VNNI build's: the same integer sums and float32 operations in the
 * same order, 8 rows (half a group) at a time. */
static inline __attribute__((always_inline)) void group_tile(
    const uint8_t* w, int64_t kind, int64_t blocks, const QuantizedRows* x, int64_t K,
    float* out, const int rows, const int levels) {
    const int64_t bytes = block_bytes(kind), codes = code_bytes(kind);
    if (levels == 2) {
        group_tile_words(w, kind, blocks, x, K, out, rows);
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 acc[QTILE_ROWS_MAX];
        for (int t = 0; t < rows; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t* p = w + b * bytes;
            __m256i v[8];
            unpack_half(p, kind, h, v);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + codes + 16 * h)));
            const __m256 mw =
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + codes + 32 + 16 * h)));
            for (int t = 0; t < rows; t++) {
                const int8_t* q = x->q + t * levels * K + b * QBLOCK;
                __m256i dot = half_dot(v, q, kind);
                if (levels == 2)
                    dot = _mm256_add_epi32(_mm256_slli_epi32(dot, QLEVEL_SHIFT),
                                           half_dot(v, q + K, kind));
                const __m256 scale =
                    _mm256_mul_ps(dw, _mm256_set1_ps(x->d[(t * levels + levels - 1) * blocks + b]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[t]);
                acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->s[t * blocks + b]), acc[t]);
            }
        }
        for (int t = 0; t < rows; t++) _mm256_storeu_ps(out + t * QGROUP + 8 * h, acc[t]);
    }
}
#else
static void group_tile(const uint8_t* w, int64_t kind, int64_t blocks, const QuantizedRows* x,
                       int64_t K, float* out, const int rows, const int levels) {
    float acc[QTILE_ROWS_MAX][QGROUP] = {{0}};
    const int64_t bytes = block_bytes(kind), codes = code_bytes(kind);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* p = w + b * bytes;
        for (int r = 0; r < QGROUP; r++) {
            uint16_t dh, mh;
            memcpy(&dh, p + codes + 2 * r, 2);
            memcpy(&mh, p + codes + 32 + 2 * r, 2);
            const float dw = half_to_float(dh), mw = half_to_float(mh);
            for (int t = 0; t < rows; t++) {
                int32_t dot = 0;
                for (int level = 0; level < levels; level++) {
                    const int8_t* a = x->q + (t * levels + level) * K + b * QBLOCK;
                    int32_t sum = 0;
                    for (int k = 0; k < QBLOCK; k++) {
                        const int j = k / 4, i = k % 4;
                        uint8_t code;
                        if (kind == QKIND_Q4) {
                            const uint8_t byte = p[64 * (j % 4) + 4 * r + i];
                            code = j < 4 ? (byte & 0x0f) : (byte >> 4);
                        } else {
                            code = p[64 * j + 4 * r + i];
                        }
                        sum += (int32_t)code * (int32_t)a[k];
                    }
                    dot = dot * (1 << QLEVEL_SHIFT) + sum;
                }
                const float d = x->d[(t * levels + levels - 1) * blocks + b];
                acc[t][r] = __builtin_fmaf((float)dot, dw * d, acc[t][r]);
                acc[t][r] = __builtin_fmaf(mw, x->s[t * blocks + b], acc[t][r]);
            }
        }
    }
    for (int t = 0; t < rows; t++)
        for (int r = 0; r < QGROUP; r++) out[t * QGROUP + r] = acc[t][r];
}
#endif

static void group_rows(const QWeight* w, int64_t g, const QuantizedRows* x, int64_t row0,
                       int rows, const QOutput* out) {
    const int64_t K = w->in_features, blocks = K / QBLOCK;
    const int levels = (int)x->levels;
    const uint8_t* data = w->data + g * blocks * block_bytes(w->kind);
    const QuantizedRows tile = {x->q + row0 * levels * K, x->d + row0 * levels * blocks,
                                x->s + row0 * blocks, K, levels, x->c + row0 * K};
    float partial[QTILE_ROWS_MAX * QGROUP];
    switch (rows * 2 + levels - 1) { /* constants for each inlined copy */
#define TILE_CASE(R, L)                                                \
    case R * 2 + L - 1:                                                \
        group_tile(data, w->kind, blocks, &tile, K, partial, R, L);    \
        break;
        TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1)
        TILE_CASE(5, 1) TILE_CASE(6, 1) TILE_CASE(7, 1) TILE_CASE(8, 1)
        TILE_CASE(1, 2) TILE_CASE(2, 2) TILE_CASE(3, 2) TILE_CASE(4, 2)
#if QTILE_ROWS_MAX > 4
        TILE_CASE(5, 2) TILE_CASE(6, 2) TILE_CASE(7, 2) TILE_CASE(8, 2)
#endif
#if QTILE_ROWS_MAX > 8
        TILE_CASE(9, 1) TILE_CASE(10, 1) TILE_CASE(11, 1) TILE_CASE(12, 1)
        TILE_CASE(9, 2) TILE_CASE(10, 2) TILE_CASE(11, 2) TILE_CASE(12, 2)
#endif
#undef TILE_CASE
    }
    const int64_t n0 = g * QGROUP;
    const int64_t width = w->out_features - n0 < QGROUP ? w->out_features - n0 : QGROUP;
    for (int t = 0; t < rows; t++)
        for (int64_t r = 0; r < width; r++) {
            const float bias = out->bias != NULL ? out->bias[n0 + r] : 0.0f;
            store_out(out->data, out->dtype, (row0 + t) * out->stride + n0 + r,
                      partial[t * QGROUP + r] + bias);
        }
}

/* Rows of x a chunk takes: chunks of about equal height (a multiple of the
 * tile) whose codes take at most about QCHUNK_BYTES, so that a chunk's codes
 * stay in L2 while every group passes over them. */
#ifndef QCHUNK_BYTES
#define QCHUNK_BYTES (256 * 1024)
#endif
static int64_t chunk_rows(int64_t rows, int64_t in_features, int64_t levels, int64_t tile) {
    int64_t most = QCHUNK_BYTES / (levels * in_features) / tile * tile;
    if (most < tile) most = tile;
    if (rows <= most) return most;
    const int64_t chunks = (rows + most - 1) / most, even = (rows + chunks - 1) / chunks;
    return (even + tile - 1) / tile * tile;
}

/* For each chunk of rows in turn, the threads share its groups (the same
 * groups to the same thread in every chunk: no barrier between chunks), and
 * meet at the end. Each output is one tile's, whatever the chunk or thread. */
void asyncstep_q_matmul_rows(const QWeight* w, const QuantizedRows* x, int64_t rows,
                             const QOutput* out) {
    const int64_t groups = (w->out_features + QGROUP - 1) / QGROUP;
    const int64_t tile = x->levels == 2 ? QTILE_ROWS_2 : QTILE_ROWS_1;
    const int64_t chunk = chunk_rows(rows, w->in_features, x->levels, tile);
    for (int64_t first = 0; first < rows; first += chunk) {
        const int64_t end = first + chunk < rows ? first + chunk : rows;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++)
            for (int64_t row0 = first; row0 < end; row0 += tile)
                group_rows(w, g, x, row0, end - row0 < tile ? (int)(end - row0) : (int)tile, out);
    }
#pragma omp barrier
}

static inline int64_t align64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

int64_t asyncstep_q_scratch_bytes(int64_t rows, int64_t in_features, int64_t levels) {
    const int64_t blocks = in_features / QBLOCK;
    return align64(rows * levels * in_features) +
           align64((int64_t)sizeof(float) * rows * (levels + 1) * blocks) +
           align64((int64_t)sizeof(int16_t) * rows * in_features);
}

QuantizedRows asyncstep_q_rows(void* scratch, int64_t rows, int64_t in_features, int64_t levels) {
    const int64_t blocks = in_features / QBLOCK;
    int8_t* q = scratch;
    float* d = (float*)(q + align64(rows * levels * in_features));
    int16_t* c = (int16_t*)((int8_t*)d +
                            align64((int64_t)sizeof(float) * rows * (levels + 1) * blocks));
    return (QuantizedRows){q, d, d + rows * levels * blocks, in_features, levels, c};
}

/* out[rows, N] = x[rows, K] @ W.T; 0 on success, -1 when scratch memory
 * cannot be had or the arguments are out of range (nothing written). */
int asyncstep_qmatmul(const QMatmulArgs* a) {
    const int64_t K = a->in_features, rows = a->rows, levels = a->levels;
    if (levels < 1 || levels > 2 || K % QBLOCK != 0 || rows < 0) return -1;
    void* scratch = aligned_alloc(64, (size_t)asyncstep_q_scratch_bytes(rows, K, levels));
    if (scratch == NULL) return -1;
    const QuantizedRows x = asyncstep_q_rows(scratch, rows, K, levels);
    const QWeight w = {a->kind, a->weight, a->out_features, K};
    const QOutput out = {a->out, a->out_dtype, a->out_stride, NULL};
    const int64_t work = rows * K * a->out_features;
    const int num_threads = work < QMIN_PARALLEL_WORK ? 1 : (int)a->num_threads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        asyncstep_q_quantize(a->x, a->dtype, a->x_stride, rows, &x);
        asyncstep_q_matmul_rows(&w, &x, rows, &out);
    }
    free(scratch);
    return 0;
}
