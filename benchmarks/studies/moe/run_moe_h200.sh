#!/usr/bin/env bash
# The fused mixture-of-experts kernel (issue 41) on one GPU (the device tool's nvidia-h200):
#     bash benchmarks/studies/moe/run_moe_h200.sh tests|kernels|all
#   tests:   tests/gpu/test_fused_moe.py compiled for the GPU (bfloat16 rounds to nearest there)
#   kernels: benchmarks/studies/moe/fused_moe_kernel.py --tiles (the kernel against the torch
#            loop and the floor, qwen3-30b-a3b and gpt-oss-20b shapes, T = 1, 32, 256)
# Output (text and JSON) goes to $OUT (default benchmarks/results/moe).
set -u
OUT=${OUT:-benchmarks/results/moe}
mkdir -p "$OUT"
run_tests() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_fused_moe.py > "$OUT/gpu_tests_moe.txt" 2>&1
    tail -4 "$OUT/gpu_tests_moe.txt"
}
run_kernels() {
    timeout 500 python3 benchmarks/studies/moe/fused_moe_kernel.py --tiles --out "$OUT/fused_moe_kernel.json" \
        2>&1 | grep -vi warn > "$OUT/fused_moe_kernel.txt"
    cat "$OUT/fused_moe_kernel.txt"
}
case "$1" in
tests) run_tests ;;
kernels) run_kernels ;;
all) run_tests; run_kernels ;;
esac
