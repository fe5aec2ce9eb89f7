/*
 * The float32 entry points that other sources of the library call
 * (cpu_f32_stack.c runs a decoder stack on them): cpu_dense_f32.c's matmul,
 * cpu_moe.c's experts and cpu_moe_router.c's router. All fields are 8
 * bytes (the Python side packs each struct with struct.Struct).
 */
#ifndef ASYNCSTEP_CPU_F32_H
#define ASYNCSTEP_CPU_F32_H
#include <stdint.h>

/* out[rows, N] = x[rows, K] @ W.T (W [N, K]), each with its row stride. */
typedef struct {
    const float* weight;
    int64_t out_features, in_features, weight_stride;
    const float* x;
    int64_t x_stride;
    float* out;
    int64_t out_stride;
    int64_t rows;
    int64_t num_threads;
} DenseF32Args;

/* 0 on success, -1 when the arguments are out of range (nothing written). */
int asyncstep_dense_f32(const DenseF32Args* a);

/* A mixture-of-experts layer's experts (cpu_moe.c says how). */
typedef struct {
    const float* hidden;
    int64_t hidden_stride;
    const void* w13; /* [E, 2I, H] contiguous: float32 or bfloat16, or MXFP4 codes [E, 2I, H / 2] */
    const void* w2;  /* [E, H, I] contiguous: float32 or bfloat16, or MXFP4 codes [E, H, I / 2] */
    int64_t num_experts, hidden_size, inter;
    const int32_t* topk_ids;   /* [T * k] */
    const float* topk_weights; /* [T * k] */
    int64_t num_tokens, top_k;
    float* scratch; /* [P * H]: pair_out, the pairs' weighted outputs */
    float* out;     /* [T, H] */
    int64_t num_threads;
    const uint8_t* w13_scales; /* MXFP4: [E, 2I, H / 32]; NULL: float32 weights */
    const uint8_t* w2_scales;  /* MXFP4: [E, H, I / 32] */
    const float* w13_bias;     /* [E, 2I] or NULL */
    const float* w2_bias;      /* [E, H] or NULL */
    int64_t activation;        /* 0: silu, 1: swigluoai */
    int64_t bf16_weights;      /* 1: w13 and w2 are bfloat16 (no scales); 0: as above */
} MoeArgs;

/* 0 on success; -1: shapes out of range or no scratch memory; -2: an
 * expert id not in [0, E) (nothing written). */
int asyncstep_moe_experts(const MoeArgs* a);

/* Each token's experts from its router logits (cpu_moe_router.c says how). */
typedef struct {
    const float* logits; /* [T, E], row stride logits_stride */
    int64_t logits_stride;
    int64_t num_tokens, num_experts, top_k;
    int64_t scoring;     /* 0: softmax, 1: sigmoid, 2: softmax of the top k logits */
    int64_t renormalize; /* the top k weights divided by their sum (scoring 0 and 1) */
    int32_t* topk_ids;   /* [T, k] */
    float* topk_weights; /* [T, k] */
    int64_t* counts;     /* [E]: each pair's expert counted; NULL: none */
} RouteArgs;

/* 0 on success, -1 when the arguments are out of range (nothing written). */
int asyncstep_moe_route(const RouteArgs* a);

#endif
