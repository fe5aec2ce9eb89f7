/*
 * cpu_kernels.c's entry points that the other sources of the library call
 * (cpu_decode.c runs the paged attention inside its decoder stack; cpu_f32_stack.c
 * the norms and silu * up too). The structs' fields are 8 bytes each: a
 * caller packs one struct (ctypes converts each argument separately).
 */
#ifndef ASYNCSTEP_CPU_KERNELS_H
#define ASYNCSTEP_CPU_KERNELS_H
#include <stdint.h>

/* Stores k/v (when both are given), then attends; returns 0, or -1 when the
 * tile plan cannot be allocated (cpu_kernels.c says how). */
int asyncstep_cpu_paged_attention(
    int dtype, void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* k,
    int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slot_mapping,
    int num_tokens, void* kv_cache, int64_t num_blocks, int block_size,
    const int32_t* query_start_loc, const int32_t* seq_lens, int num_reqs,
    const int32_t* block_table, int64_t block_table_stride, int num_heads, int num_kv_heads,
    int head_dim, float scale, const int64_t* positions, const float* cos_sin, int window,
    const float* sinks, int tq, int num_threads);


/* x, out: [rows, groups * hidden] (row strides x_stride, out_stride; out may
 * be x); residual, residual_out: [rows, hidden] float32 (strides
 * residual_stride, residual_out_stride), both only with groups == 1:
 * residual NULL: the stream starts at x; residual_out NULL: not stored (it
 * may equal residual: in place). weight: [hidden] float32. */
typedef struct {
    int64_t dtype;
    void* out;
    int64_t out_stride;
    const void* x;
    int64_t x_stride;
    const float* residual;
    int64_t residual_stride;
    float* residual_out;
    int64_t residual_out_stride;
    const float* weight;
    int64_t rows, groups, hidden;
    double eps;
    int64_t num_threads;
} NormArgs;

/* r = residual + x (x widened where residual is NULL); out = rms_norm(r) * weight. */
void asyncstep_add_rms_norm(const NormArgs* a);

/* out[rows, d] = silu(gate) * up of gate_up's rows [gate | up]. */
typedef struct {
    int64_t dtype;
    void* out;
    int64_t out_stride;
    const void* gate_up;
    int64_t in_stride;
    int64_t rows, d;
    int64_t vector_bytes;
    int64_t num_threads;
} SiluArgs;

void asyncstep_silu_and_mul(const SiluArgs* a);

#endif
