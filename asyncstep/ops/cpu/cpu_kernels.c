/*
 * The CPU's compiled kernels, one shared library (built and loaded by
 * library.py): paged attention, and the non-matmul work of a decoder
 * layer (residual add + RMSNorm, silu(gate) * up).
 *
 * Paged attention: one call per layer and step stores the step's
 * new keys and values in the paged KV cache, then attends every request's
 * query tokens (decodes and prompt chunks alike) over its cached sequence,
 * reading the cache blocks in place through the block table (no gather).
 *
 * Layouts (row strides in elements; within a row, heads are contiguous
 * [heads, head_dim] tiles):
 *   q            [num_tokens, num_heads * head_dim]
 *   k, v         [num_tokens, num_kv_heads * head_dim]      (the new tokens)
 *   out          [num_tokens, num_heads * head_dim]
 *   kv_cache     [2, num_kv_heads, num_blocks, block_size, head_dim], contiguous
 *   slot_mapping [num_tokens] int64: block_id * block_size + offset, -1: not stored
 *   query_start_loc [num_reqs + 1] int32, seq_lens [num_reqs] int32
 *   block_table  [num_reqs, >= ceil(seq_len / block_size)] int32
 *
 * With positions and cos_sin (the rotary cache [max_position, head_dim],
 * float32: cos in the first half, sin in the second) given, q and k come in
 * unrotated and are rotated (neox style) on the way: k before it is stored,
 * q as it is loaded; the inputs are not modified.
 *
 * Request r's query token i (of q_len) sees keys [0, seq_len - q_len + i]
 * (causal); with a sliding window W > 0, only the last W of them
 * [seq_len - q_len + i - W + 1, seq_len - q_len + i] (the blocks before are
 * never read, so the block table may hold anything there). With sinks (a
 * float32 logit per query head, gpt-oss), each row's softmax has its head's
 * sink as one more logit, which takes no value row: the online softmax starts
 * from it (running maximum = sink, running sum = 1) instead of from nothing,
 * then folds the keys in the same order, so a row's bits still do not depend
 * on the step's other rows. The query heads
 * sharing a KV head (grouped-query attention) are attended together, with tq query tokens of a request per work item, so a
 * key or value row read from the cache serves tq * group query rows. Scores,
 * softmax (online, per chunk of keys: the chunks start at multiples of CHUNK
 * whatever the tile, so a row's bits do not depend on the tile or the
 * batch it comes in) and accumulation are float32; bfloat16
 * inputs are widened on load and the output is rounded to nearest even.
 * Work items (request tile, KV head) are spread over OpenMP threads (a call
 * with little work runs on one); each is computed by one thread in a fixed
 * order, so results do not depend on the thread count.
 *
 * Layer ops (rows with a row stride in elements, unit stride within a row;
 * x and out of one dtype, float32 or bfloat16; residual and weight float32),
 * each the float32 arithmetic of the torch ops it replaces, in torch's order
 * (see "Layer ops" below):
 *   add + RMSNorm: r = residual + x (or r = x: the first layer), stored to
 *     residual_out (may be residual itself: in place; NULL: not stored), then
 *     out = (r * (1 / sqrt(mean(r * r) + eps))) * weight; a row may hold
 *     `groups` vectors of `hidden` values each, normalised separately
 *     (per-head norms).
 *   silu * mul: out[:, i] = silu(gate_up[:, i]) * gate_up[:, d + i].
 * Rows are spread over OpenMP threads only for large calls; each row is
 * computed by one thread, so results do not depend on the thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "cpu_kernels.h"

#define ASYNCSTEP_ABI_VERSION 6
#define CHUNK 64 /* keys per online-softmax step */
/* Query-key dot products below which a call runs on one thread: a parallel
 * region's fork and join cost more than splitting so little work saves (on
 * a loaded machine, a descheduled thread stalls the join). A batch-1 decode
 * over ~190 keys and 9 heads (1.7 k) takes 0.77x the time on two threads
 * as on one (benchmarks/results/cpu/avx2_prefetch_1206/). */
#define MIN_PARALLEL_DOTS 1024

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };


typedef struct {
    int64_t q_stride, out_stride;
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t head_stride; /* elements from one KV head's blocks to the next */
    int64_t value_offset; /* elements from the keys half to the values half */
    const int32_t* block_table;
    int64_t block_table_stride;
    float scale;
    const int64_t* positions; /* NULL: q and k come rotated */
    const float* cos_sin;
    int window; /* sliding window in keys; 0: none */
    const float* sinks; /* [num_heads] float32 logits; NULL: none */
} Layout;

typedef struct {
    int req, token_begin, num_tokens, context_begin;
} Tile;

static inline __attribute__((always_inline)) float f32_id(float x) { return x; }

/* x (D values) rotated by the angles of position pos, in place. */
static inline __attribute__((always_inline)) void rotate(const Layout* lay, float* x, int64_t pos,
                                                         const int D) {
    const int half = D / 2;
    const float* cos = lay->cos_sin + pos * D;
    const float* sin = cos + half;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/*
 * One work item: request tile->req's query tokens [token_begin, +num_tokens)
 * (absolute rows), KV head h; token j of the tile sees keys
 * [first(j), context_begin + j], first(j) = 0, or with a window W
 * context_begin + j - W + 1 (at least 0). D is a compile-time constant where
 * inlined.
 */
#define DEFINE_ATTEND_TILE(NAME, T, LOAD, STORE)                                              \
    static inline __attribute__((always_inline)) void NAME(                                   \
        const Layout* lay, T* out, const T* q, const T* cache, const Tile* tile, int h,      \
        const int D) {                                                                         \
        const int group = lay->num_heads / lay->num_kv_heads;                                  \
        const int rows = tile->num_tokens * group, bs = lay->block_size;                       \
        float qf[rows][D], acc[rows][D], s[rows][CHUNK], m[rows], l[rows];                     \
        float kf[CHUNK][D], vf[CHUNK][D];                                                      \
        for (int row = 0; row < rows; row++) {                                                 \
            const int token = tile->token_begin + row / group;                                 \
            const T* src = q + (int64_t)token * lay->q_stride + (int64_t)(h * group + row % group) * D; \
            for (int d = 0; d < D; d++) qf[row][d] = LOAD(src[d]);                             \
            if (lay->positions != NULL) rotate(lay, qf[row], lay->positions[token], D);        \
            for (int d = 0; d < D; d++) qf[row][d] *= lay->scale;                              \
            for (int d = 0; d < D; d++) acc[row][d] = 0.0f;                                    \
            /* a sink: the softmax's first logit, exp(sink - sink) = 1, no value */            \
            m[row] = lay->sinks != NULL ? lay->sinks[h * group + row % group] : -FLT_MAX;      \
            l[row] = lay->sinks != NULL ? 1.0f : 0.0f;                                         \
        }                                                                                      \
        const int num_keys = tile->context_begin + tile->num_tokens;                           \
        const int W = lay->window;                                                             \
        const int key0 = W > 0 && tile->context_begin - W + 1 > 0 ? tile->context_begin - W + 1 : 0; \
        /* chunks at multiples of CHUNK whatever the tile: a row's sums do not depend on it */ \
        const int32_t* blocks = lay->block_table + (int64_t)tile->req * lay->block_table_stride; \
        const T* keys = cache + (int64_t)h * lay->head_stride;                                 \
        const T* values = keys + lay->value_offset;                                            \
        for (int c0 = key0 / CHUNK * CHUNK; c0 < num_keys; c0 += CHUNK) {                      \
            const int cn = num_keys - c0 < CHUNK ? num_keys - c0 : CHUNK;                      \
            /* keys before the tile's first window: no row sees them, not read */             \
            for (int t = key0 > c0 ? key0 - c0 : 0; t < cn; t++) {                             \
                const int pos = c0 + t;                                                        \
                const int64_t at = ((int64_t)blocks[pos / bs] * bs + pos % bs) * D;            \
                for (int d = 0; d < D; d++) kf[t][d] = LOAD(keys[at + d]);                     \
                for (int d = 0; d < D; d++) vf[t][d] = LOAD(values[at + d]);                   \
            }                                                                                  \
            for (int row = 0; row < rows; row++) {                                             \
                const int visible = tile->context_begin + row / group + 1 - c0;                \
                const int valid = visible < cn ? visible : cn;                                 \
                const int hidden = W > 0 ? visible - W : 0; /* keys before the window */       \
                const int lo = hidden > 0 ? hidden : 0;                                        \
                if (lo >= valid) continue;                                                     \
                float top = m[row];                                                            \
                for (int t = lo; t < valid; t++) {                                             \
                    float dot = 0.0f;                                                          \
                    for (int d = 0; d < D; d++) dot += qf[row][d] * kf[t][d];                  \
                    s[row][t] = dot;                                                           \
                    top = dot > top ? dot : top;                                               \
                }                                                                              \
                const float rescale = exp_nonpositive(m[row] - top);                           \
                float sum = 0.0f;                                                              \
                for (int t = lo; t < valid; t++) {                                             \
                    const float e = exp_nonpositive(s[row][t] - top);                          \
                    s[row][t] = e;                                                             \
                    sum += e;                                                                  \
                }                                                                              \
                l[row] = l[row] * rescale + sum;                                               \
                m[row] = top;                                                                  \
                for (int d = 0; d < D; d++) acc[row][d] *= rescale;                            \
                for (int t = lo; t < valid; t++) {                                             \
                    const float w = s[row][t];                                                 \
                    for (int d = 0; d < D; d++) acc[row][d] += w * vf[t][d];                   \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int row = 0; row < rows; row++) {                                                 \
            T* dst = out + (int64_t)(tile->token_begin + row / group) * lay->out_stride +      \
                     (int64_t)(h * group + row % group) * D;                                   \
            const float inv = 1.0f / l[row];                                                   \
            for (int d = 0; d < D; d++) dst[d] = STORE(acc[row][d] * inv);                     \
        }                                                                                      \
    }

DEFINE_ATTEND_TILE(attend_tile_f32, float, f32_id, f32_id)
DEFINE_ATTEND_TILE(attend_tile_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

static void attend_tile(int dtype, const Layout* lay, void* out, const void* q,
                        const void* cache, const Tile* tile, int h) {
    /* Common head sizes get a constant D (unrolled, vectorized inner loops). */
#define DISPATCH(FN, T)                                                                  \
    switch (lay->head_dim) {                                                             \
        case 16: FN(lay, (T*)out, (const T*)q, (const T*)cache, tile, h, 16); break;      \
        case 32: FN(lay, (T*)out, (const T*)q, (const T*)cache, tile, h, 32); break;      \
        case 64: FN(lay, (T*)out, (const T*)q, (const T*)cache, tile, h, 64); break;      \
        case 128: FN(lay, (T*)out, (const T*)q, (const T*)cache, tile, h, 128); break;    \
        default: FN(lay, (T*)out, (const T*)q, (const T*)cache, tile, h, lay->head_dim);  \
    }
    if (dtype == DTYPE_BFLOAT16) {
        DISPATCH(attend_tile_bf16, bf16_t)
    } else {
        DISPATCH(attend_tile_f32, float)
    }
#undef DISPATCH
}

/* The new tokens' keys (rotated, with a rotary) and values at their slots
 * (slot -1: not stored). */
#define DEFINE_STORE_KV(NAME, T, LOAD, STORE)                                                  \
    static void NAME(const Layout* lay, T* cache, const T* k, int64_t k_stride, const T* v,   \
                     int64_t v_stride, const int64_t* slot_mapping, int num_tokens) {          \
        const int D = lay->head_dim;                                                           \
        float row[D];                                                                          \
        for (int t = 0; t < num_tokens; t++) {                                                 \
            const int64_t slot = slot_mapping[t];                                              \
            if (slot < 0) continue;                                                            \
            for (int h = 0; h < lay->num_kv_heads; h++) {                                      \
                T* dst = cache + h * lay->head_stride + slot * D;                              \
                const T* src = k + t * k_stride + (int64_t)h * D;                              \
                if (lay->positions != NULL) {                                                  \
                    for (int d = 0; d < D; d++) row[d] = LOAD(src[d]);                         \
                    rotate(lay, row, lay->positions[t], D);                                    \
                    for (int d = 0; d < D; d++) dst[d] = STORE(row[d]);                        \
                } else {                                                                       \
                    memcpy(dst, src, sizeof(T) * (size_t)D);                                   \
                }                                                                              \
                memcpy(dst + lay->value_offset, v + t * v_stride + (int64_t)h * D,             \
                       sizeof(T) * (size_t)D);                                                 \
            }                                                                                  \
        }                                                                                      \
    }

DEFINE_STORE_KV(store_kv_f32, float, f32_id, f32_id)
DEFINE_STORE_KV(store_kv_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/*
 * Tiles of tq query tokens: prompt chunks first, their last (longest) tiles
 * first, then the decodes, so the dynamic schedule starts the heaviest.
 * Returns the number written to tiles (room for one per query token).
 */
static int plan_tiles(const int32_t* query_start_loc, const int32_t* seq_lens, int num_reqs,
                      int tq, Tile* tiles) {
    int n = 0;
    for (int r = 0; r < num_reqs; r++) {
        const int begin = query_start_loc[r], end = query_start_loc[r + 1];
        if (end - begin <= 1) continue;
        const int context = seq_lens[r] - (end - begin);
        for (int s = begin + ((end - begin - 1) / tq) * tq; s >= begin; s -= tq) {
            const int count = end - s < tq ? end - s : tq;
            tiles[n++] = (Tile){r, s, count, context + (s - begin)};
        }
    }
    for (int r = 0; r < num_reqs; r++) {
        const int begin = query_start_loc[r];
        if (query_start_loc[r + 1] - begin == 1) tiles[n++] = (Tile){r, begin, 1, seq_lens[r] - 1};
    }
    return n;
}

int asyncstep_cpu_kernels_abi_version(void) { return ASYNCSTEP_ABI_VERSION; }

/* Stores k/v (when both are given), then attends; returns 0, or -1 when the
 * tile plan cannot be allocated. */
int asyncstep_cpu_paged_attention(
    int dtype, void* out, int64_t out_stride, const void* q, int64_t q_stride, const void* k,
    int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slot_mapping,
    int num_tokens, void* kv_cache, int64_t num_blocks, int block_size,
    const int32_t* query_start_loc, const int32_t* seq_lens, int num_reqs,
    const int32_t* block_table, int64_t block_table_stride, int num_heads, int num_kv_heads,
    int head_dim, float scale, const int64_t* positions, const float* cos_sin, int window,
    const float* sinks, int tq, int num_threads) {
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const Layout lay = {q_stride,   out_stride,         num_heads,   num_kv_heads,
                        head_dim,   block_size,         head_stride, head_stride * num_kv_heads,
                        block_table, block_table_stride, scale,      positions,
                        positions != NULL ? cos_sin : NULL, window, sinks};
    if (k != NULL && v != NULL) {
        if (dtype == DTYPE_BFLOAT16)
            store_kv_bf16(&lay, kv_cache, k, k_stride, v, v_stride, slot_mapping, num_tokens);
        else
            store_kv_f32(&lay, kv_cache, k, k_stride, v, v_stride, slot_mapping, num_tokens);
    }
    const int num_queries = query_start_loc[num_reqs];
    Tile* tiles = malloc(sizeof(Tile) * (size_t)(num_queries > 0 ? num_queries : 1));
    if (tiles == NULL) return -1;
    const int num_tiles = plan_tiles(query_start_loc, seq_lens, num_reqs, tq, tiles);
    const int num_items = num_tiles * num_kv_heads;
    int64_t dots = 0;
    for (int i = 0; i < num_tiles; i++)
        dots += (int64_t)tiles[i].num_tokens * (tiles[i].context_begin + tiles[i].num_tokens);
    if (dots * num_heads < MIN_PARALLEL_DOTS) num_threads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int item = 0; item < num_items; item++)
        attend_tile(dtype, &lay, out, q, kv_cache, &tiles[item / num_kv_heads],
                    item % num_kv_heads);
    free(tiles);
    return 0;
}


/* ---- Layer ops: torch's float32 arithmetic, bit for bit ------------------------- */

/*
 * These kernels replace chains of torch ops, and return what those return,
 * bit for bit (where torch's vector width is what the caller says): a
 * greedy token on a near tie then comes out as it did. So no reassociation
 * and no contraction into fused multiply-adds here (the attention above
 * keeps them), and the float32 sum of squares follows torch's order.
 */
#if defined(__clang__)
#pragma clang fp reassociate(off) contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "no-reciprocal-math", "fp-contract=off")
#endif

/* Work below which a layer op runs on one thread (as MIN_PARALLEL_DOTS): a
 * norm's values, of which a silu value is worth SILU_WORK (its exp). */
#define MIN_PARALLEL_WORK (1 << 18)
#define SILU_WORK 4
/* Lanes of torch's float32 sum kernel on x86 (Vectorized<float> of its AVX2
 * build, which it runs on AVX-512 CPUs too). */
#define SUM_LANES 8
#define SUM_ILP 4
#define SUM_LEVELS 4

static inline int layer_threads(int64_t work, int num_threads) {
    return work < MIN_PARALLEL_WORK ? 1 : num_threads;
}

static inline int64_t ceil_log2(int64_t x) {
    return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1));
}

/*
 * torch's multi_row_sum: `size` groups of SUM_ILP elements of W lanes each
 * (group i, element k at x + (i * SUM_ILP + k) * W), summed per element and
 * lane in a cascade of SUM_LEVELS accumulators; into out[k * W + lane].
 */
static inline __attribute__((always_inline)) void multi_row_sum(const float* x, int64_t size,
                                                                const int W, float* out) {
    float acc[SUM_LEVELS][SUM_ILP * W];
    memset(acc, 0, sizeof(acc));
    const int64_t level_power = ceil_log2(size) / SUM_LEVELS > 4 ? ceil_log2(size) / SUM_LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int e = 0; e < SUM_ILP * W; e++) acc[0][e] += x[i * SUM_ILP * W + e];
        for (int j = 1; j < SUM_LEVELS; j++) {
            for (int e = 0; e < SUM_ILP * W; e++) {
                acc[j][e] += acc[j - 1][e];
                acc[j - 1][e] = 0.0f;
            }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int e = 0; e < SUM_ILP * W; e++) acc[0][e] += x[i * SUM_ILP * W + e];
    for (int j = 1; j < SUM_LEVELS; j++)
        for (int e = 0; e < SUM_ILP * W; e++) acc[0][e] += acc[j][e];
    memcpy(out, acc[0], sizeof(acc[0]));
}

/* torch's row_sum: `count` elements of W lanes each; the lanes' sums into out[W]. */
static inline __attribute__((always_inline)) void row_sum(const float* x, int64_t count,
                                                          const int W, float* out) {
    const int64_t size_ilp = count / SUM_ILP;
    float partial[SUM_ILP * W];
    multi_row_sum(x, size_ilp, W, partial);
    for (int64_t i = size_ilp * SUM_ILP; i < count; i++)
        for (int l = 0; l < W; l++) partial[l] += x[i * W + l];
    for (int k = 1; k < SUM_ILP; k++)
        for (int l = 0; l < W; l++) partial[l] += partial[k * W + l];
    memcpy(out, partial, sizeof(float) * (size_t)W);
}

/* The float32 sum of x[0, n) as torch's inner-dimension sum computes it. */
static float torch_sum(const float* x, int64_t n) {
    if (n < SUM_LANES) {
        float sum;
        row_sum(x, n, 1, &sum);
        return sum;
    }
    const int64_t vectors = n / SUM_LANES;
    float lanes[SUM_LANES];
    row_sum(x, vectors, SUM_LANES, lanes);
    float total = 0.0f;
    for (int64_t i = vectors * SUM_LANES; i < n; i++) total += x[i];
    for (int l = 0; l < SUM_LANES; l++) total += lanes[l];
    return total;
}

/*
 * One vector of n values: r = residual + x (residual NULL: r = x) into r
 * (which may be residual: in place), then out = (r * (1 / sqrt(mean(r * r) +
 * eps))) * weight, as torch's rms_norm decomposes on the CPU.
 */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE)                                            \
    static inline void NAME(const T* x, const float* residual, float* r, T* out,           \
                            const float* weight, int64_t n, float eps) {                     \
        float squares[n];                                                                     \
        if (residual != NULL) {                                                               \
            for (int64_t i = 0; i < n; i++) r[i] = residual[i] + LOAD(x[i]);                  \
        } else {                                                                              \
            for (int64_t i = 0; i < n; i++) r[i] = LOAD(x[i]);                                \
        }                                                                                     \
        for (int64_t i = 0; i < n; i++) squares[i] = r[i] * r[i];                             \
        const float inv = 1.0f / sqrtf(torch_sum(squares, n) / (float)n + eps);              \
        for (int64_t i = 0; i < n; i++) out[i] = STORE((r[i] * inv) * weight[i]);             \
    }

DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32_id, f32_id)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/* The layer ops take their arguments as one struct (cpu_kernels.h). */
void asyncstep_add_rms_norm(const NormArgs* a) {
    const int64_t vectors = a->rows * a->groups, hidden = a->hidden, groups = a->groups;
    const float eps = (float)a->eps;
    const int num_threads = layer_threads(vectors * hidden, (int)a->num_threads);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t at = 0; at < vectors; at++) {
        const int64_t row = at / groups, offset = (at % groups) * hidden;
        const float* res = a->residual != NULL ? a->residual + row * a->residual_stride : NULL;
        float scratch[a->residual_out != NULL ? 1 : hidden];
        float* r = a->residual_out != NULL ? a->residual_out + row * a->residual_out_stride
                                           : scratch;
        if (a->dtype == DTYPE_BFLOAT16) {
            add_rms_norm_bf16((const bf16_t*)a->x + row * a->x_stride + offset, res, r,
                              (bf16_t*)a->out + row * a->out_stride + offset, a->weight, hidden,
                              eps);
        } else {
            add_rms_norm_f32((const float*)a->x + row * a->x_stride + offset, res, r,
                             (float*)a->out + row * a->out_stride + offset, a->weight, hidden, eps);
        }
    }
}

/*
 * exp(d) as torch's vectorized float32 exp computes it (SLEEF's expf_u10:
 * fused multiply-adds, a 2^q split in two factors, 0 below -104 and
 * infinity above 100); vectorizes.
 */
static inline __attribute__((always_inline)) float sleef_expf(float d) {
    /* q = rint(d / ln 2) by adding and subtracting 1.5 * 2^23 (exact, to nearest
     * even, for |d| below 2.9e6; larger d and NaN get a q of no meaning, and a
     * result replaced below or NaN through s), its integer from the sum's bits. */
    const float magic = 12582912.0f;
    union { float f; uint32_t u; } shifted = {.f = d * 1.442695040888963407359924681001892137426645954152985934135449406931f + magic};
    const float qf = shifted.f - magic;
    const int32_t q = (int32_t)(shifted.u - 0x4b400000u);
    float s = __builtin_fmaf(qf, -0.693145751953125f, d);
    s = __builtin_fmaf(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = __builtin_fmaf(u, s, 0.00139304355252534151077271f);
    u = __builtin_fmaf(u, s, 0.00833336077630519866943359f);
    u = __builtin_fmaf(u, s, 0.0416664853692054748535156f);
    u = __builtin_fmaf(u, s, 0.166666671633720397949219f);
    u = __builtin_fmaf(u, s, 0.5f);
    u = 1.0f + __builtin_fmaf(s * s, u, s);
    const int32_t half = q >> 1;
    union { uint32_t u; float f; } lo = {.u = (uint32_t)(half + 0x7f) << 23},
                                   hi = {.u = (uint32_t)(q - half + 0x7f) << 23};
    u = u * lo.f * hi.f;
    u = d < -104.0f ? 0.0f : u;
    return 100.0f < d ? __builtin_inff() : u;
}

/*
 * silu(gate) * up as F.silu(gate) * up computes it: silu = g / (1 + exp(-g))
 * in float32, with SLEEF's exp over the whole chunks of `chunk` values of a
 * row that torch's vector loop takes and libm's expf on the rest (its scalar
 * loop); bfloat16 rounds silu, then the product.
 */
/* f rounded to bfloat16 (to nearest even), kept as a float32. A NaN stays one
 * as long as its low 16 bits are zero: true of every NaN silu's arithmetic
 * makes from bfloat16 inputs (theirs, or the default NaN). */
static inline __attribute__((always_inline)) float round_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    c.u = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) & 0xffff0000u;
    return c.f;
}

#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE, ROUND)                               \
    static inline void NAME(const T* gate, const T* up, T* out, int64_t n, int64_t chunk) { \
        const int64_t vector_end = n - n % chunk;                                       \
        for (int64_t i = 0; i < vector_end; i++) {                                      \
            const float g = LOAD(gate[i]);                                              \
            out[i] = STORE(ROUND(g / (1.0f + sleef_expf(-g))) * LOAD(up[i]));           \
        }                                                                               \
        for (int64_t i = vector_end; i < n; i++) {                                      \
            const float g = LOAD(gate[i]);                                              \
            out[i] = STORE(ROUND(g / (1.0f + expf(-g))) * LOAD(up[i]));                 \
        }                                                                               \
    }

DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, f32_id, f32_id, f32_id)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, bf16_t, bf16_to_f32, f32_to_bf16, round_to_bf16)

/* gate_up: [rows, 2 * d] (row stride in_stride), gate first; out: [rows, d];
 * vector_bytes: the width of torch's vectors (its CPU capability's). */

void asyncstep_silu_and_mul(const SiluArgs* a) {
    const int64_t d = a->d;
    const int num_threads = layer_threads(SILU_WORK * a->rows * d, (int)a->num_threads);
    /* torch's vector loop takes two vectors a step */
    const int64_t element = a->dtype == DTYPE_BFLOAT16 ? 2 : 4;
    const int64_t chunk = 2 * (a->vector_bytes / element > 0 ? a->vector_bytes / element : 1);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t row = 0; row < a->rows; row++) {
        if (a->dtype == DTYPE_BFLOAT16) {
            const bf16_t* in = (const bf16_t*)a->gate_up + row * a->in_stride;
            silu_and_mul_bf16(in, in + d, (bf16_t*)a->out + row * a->out_stride, d, chunk);
        } else {
            const float* in = (const float*)a->gate_up + row * a->in_stride;
            silu_and_mul_f32(in, in + d, (float*)a->out + row * a->out_stride, d, chunk);
        }
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
