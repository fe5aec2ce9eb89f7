/*
 * A float32 model's decoder layers for a step on the CPU, in one call
 * (f32_stack.py builds the arguments): for each layer, the residual add +
 * RMSNorm, the QKV projection (+ bias), the q/k RMSNorms (per head, or
 * over the whole projection), rotary + KV store + paged attention, the
 * output projection (+ bias), the residual add + RMSNorm, then the
 * feed-forward: a dense gated MLP (gate/up, silu * up, down) or a mixture
 * of experts (the router's matmul (+ bias), its top k, the experts).
 *
 * Each step of a layer is the same entry point the layer-by-layer forward
 * calls through ctypes (cpu_kernels.c's norms, silu and attention,
 * cpu_dense_f32.c's matmul, cpu_moe_router.c's router, cpu_moe.c's
 * experts) with the same inputs, so the outputs are that forward's bits; what goes is the Python
 * between them (a dozen module calls, torch ops and argument packings a
 * layer). In: the stage's input hidden states and residual (float32; the
 * residual NULL on the first stage, where the stream starts at the
 * embedding). Out: the last layer's feed-forward output and the residual
 * stream after its attention, as the layer-by-layer forward returns them;
 * each MoE layer's expert counts incremented.
 */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_f32.h"
#include "cpu_kernels.h"

/* One layer (all fields 8 bytes: packed by f32_stack.py). Weights are
 * float32 [out, in], contiguous; biases NULL where absent. */
typedef struct {
    const float* input_norm; /* [H] */
    const float* qkv;        /* [q + 2 kv, H] */
    const float* qkv_bias;
    const float* q_norm; /* [q_norm_width] or NULL (then no k norm) */
    const float* k_norm; /* [k_norm_width] */
    int64_t q_norm_width, k_norm_width;
    const float* o; /* [H, q] */
    const float* o_bias;
    const float* post_norm; /* [H] */
    int64_t inter;          /* the MLP's intermediate size (an expert's) */
    /* a dense MLP (num_experts 0) */
    const float* gate_up; /* [2I, H] */
    const float* down;    /* [H, I] */
    /* a MoE layer */
    int64_t num_experts, top_k, scoring, renormalize, activation;
    const float* router; /* [E, H] */
    const float* router_bias;
    const void* w13; /* float32 [E, 2I, H], or MXFP4 codes (cpu_moe.c) */
    const void* w2;  /* float32 [E, H, I], or MXFP4 codes */
    const uint8_t* w13_scales;
    const uint8_t* w2_scales;
    const float* w13_bias;
    const float* w2_bias;
    int64_t* expert_counts; /* [E] */
    /* the attention */
    float* kv_cache; /* [2, kv_heads, num_blocks, block_size, head_dim] */
    int64_t num_blocks;
    int64_t window;     /* sliding window in keys; 0: none */
    const float* sinks; /* [num_heads] or NULL */
} F32Layer;

typedef struct {
    int64_t num_layers;
    const F32Layer* layers;
    int64_t tokens, hidden_size;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    double eps, scale;
    const float* hidden_in;
    int64_t hidden_in_stride;
    const float* residual_in; /* NULL: the stream starts at hidden_in */
    int64_t residual_in_stride;
    float* hidden_out;   /* [tokens, H] contiguous */
    float* residual_out; /* [tokens, H] contiguous */
    /* the step's attention metadata (attention.py's CpuStepArgs) */
    const int64_t* slot_mapping;
    const int32_t* query_start_loc;
    const int32_t* seq_lens;
    int64_t num_reqs;
    const int32_t* block_table;
    int64_t block_table_stride;
    const int64_t* positions;
    const float* cos_sin; /* rotary cache [max_position, head_dim] */
    int64_t tile_tokens;  /* query tokens per attention work item */
    int64_t num_threads;
    int64_t vector_bytes; /* torch's vectors (silu * up: layer_ops.py) */
} F32StackArgs;

typedef struct {
    float *normed, *qkv, *attn, *o, *mlp, *wide, *act, *topk_weights, *pairs;
    int32_t* topk_ids;
} Buffers;

static float* carve(uint8_t** at, int64_t floats) {
    float* p = (float*)*at;
    *at += (floats * 4 + 63) / 64 * 64;
    return p;
}

/* The buffers' floats (and the carving's padding) for the widest layer. */
static int64_t buffer_floats(const F32StackArgs* a, int64_t q, int64_t qkv, Buffers* b,
                             uint8_t* memory) {
    const int64_t T = a->tokens, H = a->hidden_size;
    int64_t wide = 1, inter = 1, pairs = 1;
    for (int64_t l = 0; l < a->num_layers; l++) {
        const F32Layer* L = &a->layers[l];
        const int64_t w = L->num_experts > 0 ? L->num_experts : 2 * L->inter;
        wide = w > wide ? w : wide;
        inter = L->inter > inter ? L->inter : inter;
        pairs = L->top_k > pairs ? L->top_k : pairs;
    }
    const int64_t sizes[9] = {T * H,    T * qkv,   T * q,     T * H,        T * H,
                              T * wide, T * inter, T * pairs, T * pairs * H};
    float** slots[9] = {&b->normed, &b->qkv, &b->attn,         &b->o,    &b->mlp,
                        &b->wide,   &b->act, &b->topk_weights, &b->pairs};
    int64_t total = (T * pairs * 4 + 63) / 64 * 16; /* the ids (int32) */
    uint8_t* at = memory;
    for (int i = 0; i < 9; i++) {
        total += (sizes[i] * 4 + 63) / 64 * 16;
        if (memory != NULL) *slots[i] = carve(&at, sizes[i]);
    }
    if (memory != NULL) b->topk_ids = (int32_t*)(void*)carve(&at, T * pairs);
    return total;
}

static void norm(const F32StackArgs* a, float* out, int64_t out_stride, const float* x,
                 int64_t x_stride, const float* residual, int64_t residual_stride,
                 float* residual_out, const float* weight, int64_t groups, int64_t width) {
    const NormArgs args = {0,        out,          out_stride, x,      x_stride,
                           residual, residual_stride, residual_out, residual_out == NULL ? 0 : a->hidden_size,
                           weight,   a->tokens,    groups,     width,  a->eps,
                           a->num_threads};
    asyncstep_add_rms_norm(&args);
}

/* out[T, N] = x[T, K] @ W.T (+ bias). */
static int matmul(const F32StackArgs* a, const float* w, int64_t n, int64_t k, const float* x,
                  int64_t x_stride, float* out, const float* bias) {
    const DenseF32Args args = {w, n, k, k, x, x_stride, out, n, a->tokens, a->num_threads};
    if (asyncstep_dense_f32(&args) != 0) return -1;
    if (bias != NULL)
        for (int64_t t = 0; t < a->tokens; t++)
            for (int64_t i = 0; i < n; i++) out[t * n + i] += bias[i];
    return 0;
}

static int attention(const F32StackArgs* a, const F32Layer* L, const Buffers* b, int64_t q,
                     int64_t kv, int64_t qkv) {
    const float* x = b->qkv;
    if (L->q_norm != NULL) { /* in place: each vector is read whole before it is written */
        norm(a, b->qkv, qkv, x, qkv, NULL, 0, NULL, L->q_norm, q / L->q_norm_width,
             L->q_norm_width);
        norm(a, b->qkv + q, qkv, x + q, qkv, NULL, 0, NULL, L->k_norm, kv / L->k_norm_width,
             L->k_norm_width);
    }
    return asyncstep_cpu_paged_attention(
        0, b->attn, q, x, qkv, x + q, qkv, x + q + kv, qkv, a->slot_mapping, (int)a->tokens,
        L->kv_cache, L->num_blocks, (int)a->block_size, a->query_start_loc, a->seq_lens,
        (int)a->num_reqs, a->block_table, a->block_table_stride, (int)a->num_heads,
        (int)a->num_kv_heads, (int)a->head_dim, (float)a->scale, a->positions, a->cos_sin,
        (int)L->window, L->sinks, (int)a->tile_tokens, (int)a->num_threads);
}

/* The feed-forward of b->normed into out. */
static int feed_forward(const F32StackArgs* a, const F32Layer* L, const Buffers* b, float* out) {
    const int64_t T = a->tokens, H = a->hidden_size, I = L->inter;
    if (L->num_experts == 0) {
        if (matmul(a, L->gate_up, 2 * I, H, b->normed, H, b->wide, NULL) != 0) return -1;
        const SiluArgs silu = {0, b->act, I, b->wide, 2 * I, T, I, a->vector_bytes,
                               a->num_threads};
        asyncstep_silu_and_mul(&silu);
        return matmul(a, L->down, H, I, b->act, I, out, NULL);
    }
    const int64_t E = L->num_experts, k = L->top_k;
    if (matmul(a, L->router, E, H, b->normed, H, b->wide, L->router_bias) != 0) return -1;
    const RouteArgs route = {b->wide,       E, T, E, k, L->scoring, L->renormalize, b->topk_ids,
                             b->topk_weights, L->expert_counts};
    if (asyncstep_moe_route(&route) != 0) return -1;
    const MoeArgs experts = {b->normed,    H,           L->w13,      L->w2,
                             E,            H,           I,           b->topk_ids,
                             b->topk_weights, T,        k,           b->pairs,
                             out,          a->num_threads, L->w13_scales, L->w2_scales,
                             L->w13_bias,  L->w2_bias,  L->activation};
    return asyncstep_moe_experts(&experts) == 0 ? 0 : -1;
}

/* Runs the stack; 0 on success, -1 when memory cannot be had or a kernel
 * refuses its arguments (the KV caches of the layers run are written). */
int asyncstep_f32_stack(const F32StackArgs* a) {
    const int64_t T = a->tokens, H = a->hidden_size;
    const int64_t q = a->num_heads * a->head_dim, kv = a->num_kv_heads * a->head_dim;
    const int64_t qkv = q + 2 * kv;
    if (T < 1 || H < 1 || a->num_layers < 1) return -1;
    Buffers b = {0};
    const int64_t floats = buffer_floats(a, q, qkv, &b, NULL);
    uint8_t* memory = aligned_alloc(64, (size_t)floats * 4);
    if (memory == NULL) return -1;
    buffer_floats(a, q, qkv, &b, memory);
    float* r = a->residual_out;
    int status = 0;
    for (int64_t l = 0; l < a->num_layers && status == 0; l++) {
        const F32Layer* L = &a->layers[l];
        const int last = l == a->num_layers - 1;
        if (l == 0)
            norm(a, b.normed, H, a->hidden_in, a->hidden_in_stride, a->residual_in,
                 a->residual_in_stride, r, L->input_norm, 1, H);
        else
            norm(a, b.normed, H, b.mlp, H, r, H, r, L->input_norm, 1, H);
        status = matmul(a, L->qkv, qkv, H, b.normed, H, b.qkv, L->qkv_bias);
        if (status == 0) status = attention(a, L, &b, q, kv, qkv);
        if (status == 0) status = matmul(a, L->o, H, q, b.attn, q, b.o, L->o_bias);
        if (status != 0) break;
        norm(a, b.normed, H, b.o, H, r, H, r, L->post_norm, 1, H);
        status = feed_forward(a, L, &b, last ? a->hidden_out : b.mlp);
    }
    free(memory);
    return status;
}
