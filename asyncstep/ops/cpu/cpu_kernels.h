/*
 * cpu_kernels.c's entry points that the other sources of the library call
 * (cpu_decode.c runs the paged attention inside its decoder stack).
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

#endif
