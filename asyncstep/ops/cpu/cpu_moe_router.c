/*
 * A mixture-of-experts layer's router on the CPU (built into the library of
 * library.py beside cpu_moe.c, whose experts take its ids and weights):
 * each token's top k experts of its float32 router logits (RouteArgs,
 * cpu_f32.h), and each chosen expert counted into `counts` where given.
 * Scoring 0: p = softmax (m the row's largest logit, e_i = expf(l_i - m),
 * their sum in expert order, p_i = e_i / sum); 1: p_i = 1 / (1 + expf(-l_i));
 * the k largest p in descending order, ties to the lower expert id (torch's
 * topk), divided by their sum (in that order) where renormalize. Scoring 2
 * (gpt-oss): the k largest logits, ties likewise, then their softmax. A row
 * of NaNs still picks k distinct ids in [0, E). Every sum runs in its loop's
 * order (a volatile accumulator: the library's reassociation cannot
 * regroup it), so every build gives the same bits.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu_f32.h"

static float ordered_sum(const float* x, int64_t n) {
    volatile float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum = sum + x[i];
    return sum;
}

static void route_row(const RouteArgs* a, const float* logits, int32_t* ids, float* weights) {
    const int64_t E = a->num_experts, k = a->top_k;
    float p[E];
    if (a->scoring == 0) {
        float m = logits[0];
        for (int64_t i = 1; i < E; i++) m = logits[i] > m ? logits[i] : m;
        for (int64_t i = 0; i < E; i++) p[i] = expf(logits[i] - m);
        const float sum = ordered_sum(p, E);
        for (int64_t i = 0; i < E; i++) p[i] = p[i] / sum;
    } else if (a->scoring == 1) {
        for (int64_t i = 0; i < E; i++) p[i] = 1.0f / (1.0f + expf(-logits[i]));
    } else {
        for (int64_t i = 0; i < E; i++) p[i] = logits[i];
    }
    uint8_t taken[E];
    for (int64_t i = 0; i < E; i++) taken[i] = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < E; i++)
            if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
        taken[best] = 1;
        ids[j] = (int32_t)best;
        weights[j] = p[best];
    }
    if (a->scoring == 2) {
        const float m = weights[0];
        for (int64_t j = 0; j < k; j++) weights[j] = expf(weights[j] - m);
    }
    if (a->scoring == 2 || a->renormalize) {
        const float sum = ordered_sum(weights, k);
        for (int64_t j = 0; j < k; j++) weights[j] = weights[j] / sum;
    }
}

int asyncstep_moe_route(const RouteArgs* a) {
    const int64_t E = a->num_experts, k = a->top_k;
    if (E < 1 || E > 4096 || k < 1 || k > E || a->num_tokens < 0 || a->logits_stride < E ||
        a->scoring < 0 || a->scoring > 2)
        return -1;
    for (int64_t t = 0; t < a->num_tokens; t++) {
        int32_t* ids = a->topk_ids + t * k;
        route_row(a, a->logits + t * a->logits_stride, ids, a->topk_weights + t * k);
        if (a->counts != NULL)
            for (int64_t j = 0; j < k; j++) a->counts[ids[j]]++;
    }
    return 0;
}
