/*
 * The CPU's compiled kernels, one shared library (built and loaded by
 * cpu_kernels.py): paged attention, and the non-matmul work of a decoder
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
 * (causal). The query heads sharing a KV head (grouped-query attention) are
 * attended together, with tq query tokens of a request per work item, so a
 * key or value row read from the cache serves tq * group query rows. Scores,
 * softmax (online, per chunk of keys) and accumulation are float32; bfloat16
 * inputs are widened on load and the output is rounded to nearest even.
 * Work items (request tile, KV head) are spread over OpenMP threads (a call
 * with little work runs on one); each is computed by one thread in a fixed
 * order, so results do not depend on the thread count.
 *
 * Layer ops (rows with a row stride in elements, unit stride within a row;
 * x and out of one dtype, float32 or bfloat16; residual and weight float32):
 *   add + RMSNorm: r = residual + x (or r = x: the first layer), stored to
 *     residual_out (may be residual itself: in place; NULL: not stored), then
 *     out = (r * 1 / sqrt(mean(r^2) + eps)) * weight, computed in float32 and
 *     rounded once; a row may hold `groups` vectors of `hidden` values each,
 *     normalised separately (per-head norms).
 *   silu * mul: out[:, i] = silu(gate_up[:, i]) * gate_up[:, d + i], in float32,
 *     rounded once.
 * Rows are spread over OpenMP threads only for large calls; each row is
 * computed by one thread, so results do not depend on the thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ASYNCSTEP_ABI_VERSION 3
#define CHUNK 64 /* keys per online-softmax step */
/* Query-key dot products below which a call runs on one thread: a parallel
 * region's fork and join cost more than splitting so little work saves (on
 * a loaded machine, a descheduled thread stalls the join). */
#define MIN_PARALLEL_DOTS 8192

enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

typedef uint16_t bf16_t;

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
} Layout;

typedef struct {
    int req, token_begin, num_tokens, context_begin;
} Tile;

static inline float bf16_to_f32(bf16_t x) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)x << 16};
    return c.f;
}

static inline bf16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

static inline float f32_id(float x) { return x; }

/* exp(x) for x <= 0, Cephes' polynomial; branch-free, so loops over it vectorize. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } c = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return p * c.f;
}

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
 * [0, context_begin + j]. D is a compile-time constant where inlined.
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
            m[row] = -FLT_MAX;                                                                 \
            l[row] = 0.0f;                                                                     \
        }                                                                                      \
        const int num_keys = tile->context_begin + tile->num_tokens;                           \
        const int32_t* blocks = lay->block_table + (int64_t)tile->req * lay->block_table_stride; \
        const T* keys = cache + (int64_t)h * lay->head_stride;                                 \
        const T* values = keys + lay->value_offset;                                            \
        for (int c0 = 0; c0 < num_keys; c0 += CHUNK) {                                         \
            const int cn = num_keys - c0 < CHUNK ? num_keys - c0 : CHUNK;                      \
            for (int t = 0; t < cn; t++) {                                                     \
                const int pos = c0 + t;                                                        \
                const int64_t at = ((int64_t)blocks[pos / bs] * bs + pos % bs) * D;            \
                for (int d = 0; d < D; d++) kf[t][d] = LOAD(keys[at + d]);                     \
                for (int d = 0; d < D; d++) vf[t][d] = LOAD(values[at + d]);                   \
            }                                                                                  \
            for (int row = 0; row < rows; row++) {                                             \
                const int visible = tile->context_begin + row / group + 1 - c0;                \
                const int valid = visible < cn ? visible : cn;                                 \
                float top = m[row];                                                            \
                for (int t = 0; t < valid; t++) {                                              \
                    float dot = 0.0f;                                                          \
                    for (int d = 0; d < D; d++) dot += qf[row][d] * kf[t][d];                  \
                    s[row][t] = dot;                                                           \
                    top = dot > top ? dot : top;                                               \
                }                                                                              \
                const float rescale = exp_nonpositive(m[row] - top);                           \
                float sum = 0.0f;                                                              \
                for (int t = 0; t < valid; t++) {                                              \
                    const float e = exp_nonpositive(s[row][t] - top);                          \
                    s[row][t] = e;                                                             \
                    sum += e;                                                                  \
                }                                                                              \
                l[row] = l[row] * rescale + sum;                                               \
                m[row] = top;                                                                  \
                for (int d = 0; d < D; d++) acc[row][d] *= rescale;                            \
                for (int t = 0; t < valid; t++) {                                              \
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
    int head_dim, float scale, const int64_t* positions, const float* cos_sin, int tq,
    int num_threads) {
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const Layout lay = {q_stride,   out_stride,         num_heads,   num_kv_heads,
                        head_dim,   block_size,         head_stride, head_stride * num_kv_heads,
                        block_table, block_table_stride, scale,      positions,
                        positions != NULL ? cos_sin : NULL};
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


/* ---- Layer ops ---------------------------------------------------------------- */

/* Values below which a layer op runs on one thread (as MIN_PARALLEL_DOTS). */
#define MIN_PARALLEL_VALUES (1 << 18)

static inline int layer_threads(int64_t values, int num_threads) {
    return values < MIN_PARALLEL_VALUES ? 1 : num_threads;
}

/* exp(x), saturating at exp(+-87..88) (silu needs no more): exp_nonpositive's
 * polynomial holds for x up to 88, where 2^n is still a normal float. */
static inline float exp_saturated(float x) { return exp_nonpositive(x > 88.0f ? 88.0f : x); }

/* One row's vectors: r = residual + x (residual NULL: r = x) into r (which
 * may be residual: in place), then out = r normalised, times weight. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE)                                            \
    static inline void NAME(const T* x, const float* residual, float* r, T* out,           \
                            const float* weight, int n, float eps) {                         \
        float sum = 0.0f;                                                                     \
        if (residual != NULL) {                                                               \
            for (int i = 0; i < n; i++) {                                                     \
                const float v = residual[i] + LOAD(x[i]);                                     \
                r[i] = v;                                                                     \
                sum += v * v;                                                                 \
            }                                                                                 \
        } else {                                                                              \
            for (int i = 0; i < n; i++) {                                                     \
                const float v = LOAD(x[i]);                                                   \
                r[i] = v;                                                                     \
                sum += v * v;                                                                 \
            }                                                                                 \
        }                                                                                     \
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);                                 \
        for (int i = 0; i < n; i++) out[i] = STORE(r[i] * inv * weight[i]);                   \
    }

DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32_id, f32_id)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/*
 * The layer ops take their arguments as one struct (ctypes converts each
 * argument of a call separately, at a cost a batch-1 step pays per call;
 * one struct packed by the caller is one argument). All fields are 8 bytes.
 *
 * x, out: [rows, groups * hidden] (row strides x_stride, out_stride);
 * residual, residual_out: [rows, hidden] float32 (strides residual_stride,
 * residual_out_stride), both only with groups == 1: residual NULL: the
 * stream starts at x; residual_out NULL: not stored (it may equal residual:
 * in place). weight: [hidden] float32.
 */
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

void asyncstep_add_rms_norm(const NormArgs* a) {
    const int64_t vectors = a->rows * a->groups;
    const int hidden = (int)a->hidden, groups = (int)a->groups;
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

#define DEFINE_SILU_AND_MUL(NAME, T, LOAD, STORE)                                      \
    static inline void NAME(const T* gate, const T* up, T* out, int n) {                 \
        for (int i = 0; i < n; i++) {                                                   \
            const float g = LOAD(gate[i]);                                              \
            out[i] = STORE(g / (1.0f + exp_saturated(-g)) * LOAD(up[i]));               \
        }                                                                               \
    }

DEFINE_SILU_AND_MUL(silu_and_mul_f32, float, f32_id, f32_id)
DEFINE_SILU_AND_MUL(silu_and_mul_bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/* gate_up: [rows, 2 * d] (row stride in_stride), gate first; out: [rows, d]. */
typedef struct {
    int64_t dtype;
    void* out;
    int64_t out_stride;
    const void* gate_up;
    int64_t in_stride;
    int64_t rows, d;
    int64_t num_threads;
} SiluArgs;

void asyncstep_silu_and_mul(const SiluArgs* a) {
    const int d = (int)a->d;
    const int num_threads = layer_threads(a->rows * d, (int)a->num_threads);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t row = 0; row < a->rows; row++) {
        if (a->dtype == DTYPE_BFLOAT16) {
            const bf16_t* in = (const bf16_t*)a->gate_up + row * a->in_stride;
            silu_and_mul_bf16(in, in + d, (bf16_t*)a->out + row * a->out_stride, d);
        } else {
            const float* in = (const float*)a->gate_up + row * a->in_stride;
            silu_and_mul_f32(in, in + d, (float*)a->out + row * a->out_stride, d);
        }
    }
}
