#include <stdint.h>
#include "cpu_common.h"
#include "cpu_quant.h"
/* cpu_decode.c's silu_mul_quantize before the fusion (b689060), verbatim. */
void old_silu_mul_quantize(const float* gate_up, int64_t rows, int64_t d, const QuantizedRows* out) {
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
