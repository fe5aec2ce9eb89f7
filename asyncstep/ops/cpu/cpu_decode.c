/*
 * A pipeline stage's decoder layers for a step on the CPU, in one
 * call (cpu_decode.py builds the arguments): for each layer, residual add +
 * RMSNorm, the QKV projection (+ bias), rotary + KV store + paged attention
 * (cpu_kernels.c's), the output projection, residual add + RMSNorm, gate/up,
 * silu * up and down; every projection a quantized matmul (cpu_quant.c).
 * A token costs 3 parallel regions a layer instead of a dozen Python calls.
 *
 * The residual stream and every value between the matmuls stay float32
 * (the matmuls quantize their inputs per block, as cpu_quant.c says); q, k
 * and v, the KV cache and the attention's output are of the model's dtype,
 * as the attention kernel takes them. In: the stage's input hidden states
 * (model dtype) and residual (float32, or none: the first stage, where the
 * stream starts at the embedding). Out: the last layer's MLP output (model
 * dtype) and the residual stream after its attention (float32), as the
 * layer-by-layer forward returns them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "cpu_kernels.h"
#include "cpu_quant.h"

/* Built with -DASYNCSTEP_STACK_PROFILE (benchmarks/studies/cpu_kernels/
 * stack_profile.py only): each phase's wall seconds, summed over calls,
 * read and reset by asyncstep_stack_profile(). */
#ifdef ASYNCSTEP_STACK_PROFILE
#include <time.h>
enum { PROFILE_PHASES = 10 };
static double stack_profile[PROFILE_PHASES];
static double profile_at;
static double profile_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
/* After a worksharing loop's barrier: the time since the last mark to `phase`. */
#define PROFILE_MARK(phase)                                 \
    _Pragma("omp master") {                                 \
        const double now_ = profile_now();                  \
        stack_profile[phase] += now_ - profile_at;          \
        profile_at = now_;                                  \
    }
void asyncstep_stack_profile(double* out) {
    for (int i = 0; i < PROFILE_PHASES; i++) {
        out[i] = stack_profile[i];
        stack_profile[i] = 0.0;
    }
}
#else
#define PROFILE_MARK(phase)
#endif

/* One layer's weights (all fields 8 bytes: built by ctypes). */
typedef struct {
    const float* input_norm; /* [hidden] */
    QWeight qkv;
    const float* qkv_bias; /* [q + 2 kv] float32, or NULL */
    QWeight o;
    const float* post_norm; /* [hidden] */
    QWeight gate_up;
    QWeight down;
    void* kv_cache; /* [2, kv_heads, num_blocks, block_size, head_dim], model dtype */
    int64_t num_blocks;
    int64_t window; /* the layer's sliding window in keys; 0: none */
    const float* sinks; /* [num_heads] float32 attention sinks, or NULL */
} StackLayer;

typedef struct {
    int64_t dtype; /* the model's: q/k/v, KV cache, hidden in and out */
    int64_t num_layers;
    const StackLayer* layers;
    int64_t tokens, hidden_size, intermediate_size;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    double eps, scale;
    int64_t levels; /* activation codes per value (cpu_quant.c) */
    const void* hidden_in;
    int64_t hidden_in_stride;
    const float* residual_in; /* NULL: the stream starts at hidden_in */
    int64_t residual_in_stride;
    void* hidden_out;     /* [tokens, hidden], contiguous */
    float* residual_out;  /* [tokens, hidden], contiguous */
    /* the step's attention metadata (attention.py's CpuStepArgs) */
    const int64_t* slot_mapping;
    const int32_t* query_start_loc;
    const int32_t* seq_lens;
    int64_t num_reqs;
    const int32_t* block_table;
    int64_t block_table_stride;
    const int64_t* positions;
    const float* cos_sin; /* rotary cache [max_position, head_dim] float32 */
    int64_t tile_tokens;  /* query tokens per attention work item */
    int64_t num_threads;
} StackArgs;

static inline float load(const void* x, int64_t dtype, int64_t i) {
    return dtype == QDTYPE_BFLOAT16 ? bf16_to_f32(((const bf16_t*)x)[i]) : ((const float*)x)[i];
}

/* r += add (when given); the row's RMSNorm times weight quantized as row t. */
static void add_norm_quantize(float* r, const float* add, const float* weight, int64_t n,
                              float eps, int64_t t, const QuantizedRows* out) {
    float normed[n];
    float squares = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        if (add != NULL) r[i] += add[i];
        squares += r[i] * r[i];
    }
    const float inv = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) normed[i] = r[i] * inv * weight[i];
    for (int64_t b = 0; b < n / QBLOCK; b++)
        asyncstep_q_quantize_block(normed + b * QBLOCK, t, b, out);
}

/* silu(gate) * up of every row, quantized block by block. */
static void silu_mul_quantize(const float* gate_up, int64_t rows, int64_t d,
                              const QuantizedRows* out) {
    const int64_t blocks = d / QBLOCK;
#pragma omp for schedule(static)
    for (int64_t at = 0; at < rows * blocks; at++) {
        const int64_t t = at / blocks, b = at % blocks;
        const float* gate = gate_up + t * 2 * d + b * QBLOCK;
        const float* up = gate + d;
        float act[QBLOCK];
        for (int i = 0; i < QBLOCK; i++) {
            const float minus = -gate[i] < 88.0f ? -gate[i] : 88.0f;
            act[i] = gate[i] / (1.0f + exp_nonpositive(minus)) * up[i];
        }
        asyncstep_q_quantize_block(act, t, b, out);
    }
}

typedef struct {
    float *hidden, *o, *gate_up;
    void *qkv, *attn;
    QuantizedRows by_hidden, by_heads, by_intermediate;
} Buffers;

static void* carve(uint8_t** at, int64_t bytes) {
    void* p = *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

static int64_t buffer_bytes(const StackArgs* a, int64_t q_size, int64_t qkv_size) {
    const int64_t T = a->tokens, H = a->hidden_size, I = a->intermediate_size;
    const int64_t el = a->dtype == QDTYPE_BFLOAT16 ? 2 : 4, pad = 64;
    return 2 * T * H * 4 + 2 * T * I * 4 + T * qkv_size * el + T * q_size * el + 5 * pad +
           asyncstep_q_scratch_bytes(T, H, a->levels) +
           asyncstep_q_scratch_bytes(T, q_size, a->levels) +
           asyncstep_q_scratch_bytes(T, I, a->levels) + 3 * pad;
}

static Buffers carve_buffers(void* memory, const StackArgs* a, int64_t q_size, int64_t qkv_size) {
    const int64_t T = a->tokens, H = a->hidden_size, I = a->intermediate_size;
    const int64_t el = a->dtype == QDTYPE_BFLOAT16 ? 2 : 4;
    uint8_t* at = memory;
    Buffers b;
    b.hidden = carve(&at, T * H * 4);
    b.o = carve(&at, T * H * 4);
    b.gate_up = carve(&at, T * 2 * I * 4);
    b.qkv = carve(&at, T * qkv_size * el);
    b.attn = carve(&at, T * q_size * el);
    b.by_hidden = asyncstep_q_rows(carve(&at, asyncstep_q_scratch_bytes(T, H, a->levels)), T, H,
                                   a->levels);
    b.by_heads = asyncstep_q_rows(carve(&at, asyncstep_q_scratch_bytes(T, q_size, a->levels)), T,
                                  q_size, a->levels);
    b.by_intermediate = asyncstep_q_rows(
        carve(&at, asyncstep_q_scratch_bytes(T, I, a->levels)), T, I, a->levels);
    return b;
}

/* Runs the stack; 0 on success, -1 when memory cannot be had (nothing written
 * but the KV cache of layers already run) or the arguments are out of range. */
int asyncstep_decode_stack(const StackArgs* a) {
    const int64_t T = a->tokens, H = a->hidden_size, I = a->intermediate_size;
    const int64_t q_size = a->num_heads * a->head_dim, kv_size = a->num_kv_heads * a->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, el = a->dtype == QDTYPE_BFLOAT16 ? 2 : 4;
    if (T < 1 || H % QBLOCK || I % QBLOCK || q_size % QBLOCK || a->levels < 1 || a->levels > 2)
        return -1;
    void* memory = aligned_alloc(64, (size_t)buffer_bytes(a, q_size, qkv_size));
    if (memory == NULL) return -1;
    const Buffers buf = carve_buffers(memory, a, q_size, qkv_size);
    const float eps = (float)a->eps;
    const int num_threads = (int)a->num_threads;
    float* r = a->residual_out;
#ifdef ASYNCSTEP_STACK_PROFILE
    profile_at = profile_now();
#endif
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < H; i++) {
            const float base = a->residual_in != NULL ? a->residual_in[t * a->residual_in_stride + i]
                                                      : 0.0f;
            r[t * H + i] = base + load(a->hidden_in, a->dtype, t * a->hidden_in_stride + i);
        }
    const QOutput qkv_out = {buf.qkv, a->dtype, qkv_size, NULL};
    const QOutput o_out = {buf.o, QDTYPE_FLOAT32, H, NULL};
    const QOutput gate_up_out = {buf.gate_up, QDTYPE_FLOAT32, 2 * I, NULL};
    const QOutput down_out = {buf.hidden, QDTYPE_FLOAT32, H, NULL};
    int status = 0;
    for (int64_t l = 0; l < a->num_layers && status == 0; l++) {
        const StackLayer* L = &a->layers[l];
        const QOutput qkv_biased = {qkv_out.data, qkv_out.dtype, qkv_out.stride, L->qkv_bias};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                add_norm_quantize(r + t * H, l > 0 ? buf.hidden + t * H : NULL, L->input_norm, H,
                                  eps, t, &buf.by_hidden);
            PROFILE_MARK(0)
            asyncstep_q_matmul_rows(&L->qkv, &buf.by_hidden, T, &qkv_biased);
            PROFILE_MARK(1)
        }
        const uint8_t* qkv = buf.qkv;
        status = asyncstep_cpu_paged_attention(
            (int)a->dtype, buf.attn, q_size, qkv, qkv_size, qkv + q_size * el, qkv_size,
            qkv + (q_size + kv_size) * el, qkv_size, a->slot_mapping, (int)T, L->kv_cache,
            L->num_blocks, (int)a->block_size, a->query_start_loc, a->seq_lens, (int)a->num_reqs,
            a->block_table, a->block_table_stride, (int)a->num_heads, (int)a->num_kv_heads,
            (int)a->head_dim, (float)a->scale, a->positions, a->cos_sin, (int)L->window,
            L->sinks, (int)a->tile_tokens, num_threads);
        if (status != 0) break;
        PROFILE_MARK(2)
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
            asyncstep_q_quantize(buf.attn, a->dtype, q_size, T, &buf.by_heads);
            PROFILE_MARK(3)
            asyncstep_q_matmul_rows(&L->o, &buf.by_heads, T, &o_out);
            PROFILE_MARK(4)
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                add_norm_quantize(r + t * H, buf.o + t * H, L->post_norm, H, eps, t,
                                  &buf.by_hidden);
            PROFILE_MARK(5)
            asyncstep_q_matmul_rows(&L->gate_up, &buf.by_hidden, T, &gate_up_out);
            PROFILE_MARK(6)
            silu_mul_quantize(buf.gate_up, T, I, &buf.by_intermediate);
            PROFILE_MARK(7)
            asyncstep_q_matmul_rows(&L->down, &buf.by_intermediate, T, &down_out);
            PROFILE_MARK(8)
        }
    }
    if (status == 0) {
        for (int64_t i = 0; i < T * H; i++) {
            if (a->dtype == QDTYPE_BFLOAT16)
                ((bf16_t*)a->hidden_out)[i] = f32_to_bf16(buf.hidden[i]);
            else
                ((float*)a->hidden_out)[i] = buf.hidden[i];
        }
    }
    PROFILE_MARK(9)
    free(memory);
    return status;
}
