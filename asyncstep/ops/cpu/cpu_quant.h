/*
 * The quantized matmul's pieces that the decode stack (cpu_decode.c) calls
 * inside its own parallel regions (cpu_quant.c says what they compute).
 * Each piece is an orphaned OpenMP worksharing loop: called inside a
 * parallel region the threads share it (and meet at its end); called
 * outside one, the calling thread does it all.
 */
#ifndef ASYNCSTEP_CPU_QUANT_H
#define ASYNCSTEP_CPU_QUANT_H
#include <stdint.h>

#define QBLOCK 32 /* input features per block */
#define QGROUP 16 /* output rows per group (one float32 vector) */

enum { QKIND_Q4 = 0, QKIND_Q8 = 1 };
enum { QDTYPE_FLOAT32 = 0, QDTYPE_BFLOAT16 = 1 };
/* Which build the matmul runs (asyncstep_qmatmul_fast()): 0 is plain C. */
#define QMATMUL_ISA_PLAIN 0
#define QMATMUL_ISA_VNNI 1
#define QMATMUL_ISA_AVX2 2

/* A weight in the packed layout. All fields 8 bytes (structs from ctypes). */
typedef struct {
    int64_t kind;
    const uint8_t* data;
    int64_t out_features, in_features;
} QWeight;

/* Quantized rows of x: for each row and block of 32 values, `levels` int8
 * codes and scales (row r's level l of block b: codes at q[(r * levels + l)
 * * K + 32 b], scale at d[(r * levels + l) * blocks + b]) and the block's
 * sum as its codes give it back (s[r * blocks + b]). With two levels the
 * AVX2 build also keeps each value's two codes as one 16-bit code
 * 256 q1 + q2 (c[r * K + 32 b ...], in the pairs its vpmaddwd takes:
 * cpu_quant.c); elsewhere c is not written. */
typedef struct {
    int8_t* q;
    float *d, *s;
    int64_t in_features, levels;
    int16_t* c;
} QuantizedRows;

/* Where a matmul writes: [rows, out_features] of dtype, row stride in
 * elements, plus a float32 bias (NULL: none). */
typedef struct {
    void* data;
    int64_t dtype, stride;
    const float* bias;
} QOutput;

/* Bytes of QuantizedRows for `rows` rows (q, then d and s), 64-aligned. */
int64_t asyncstep_q_scratch_bytes(int64_t rows, int64_t in_features, int64_t levels);
/* QuantizedRows laid out in `scratch` (asyncstep_q_scratch_bytes of it). */
QuantizedRows asyncstep_q_rows(void* scratch, int64_t rows, int64_t in_features, int64_t levels);
/* Rows of x ([rows, K] of dtype, row stride x_stride) quantized: a
 * worksharing loop over the rows' blocks. */
void asyncstep_q_quantize(const void* x, int64_t dtype, int64_t x_stride, int64_t rows,
                          const QuantizedRows* out);
/* One block (32 float32 values) of row `row` quantized, by the calling thread. */
void asyncstep_q_quantize_block(const float* values, int64_t row, int64_t block,
                                const QuantizedRows* out);
/* out = x @ w.T (+ bias): for each chunk of rows in turn, a worksharing loop
 * over w's groups of 16 rows (no wait between chunks; the threads meet at
 * the end). */
void asyncstep_q_matmul_rows(const QWeight* w, const QuantizedRows* x, int64_t rows,
                             const QOutput* out);

#endif
