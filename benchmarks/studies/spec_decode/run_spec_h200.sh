#!/usr/bin/env bash
# Speculative decoding on one H200 (issue 25; the device tool's nvidia-h200):
#     bash benchmarks/studies/spec_decode/run_spec_h200.sh bench|tests|all
#   bench: benchmarks/studies/spec_decode/spec_decode_gpu.py, llama-8b dummy bf16, batch 1: without
#          speculation, n-gram k = 3 and 4, always-wrong drafts k = 3, without again,
#          without speculation and async scheduling; one profiled request each
#   profile: B's starting point, benchmarks/studies/decode_kernels/quant_step_kernels.py: llama-8b bf16,
#          llama-1b bf16, llama-8b Q4 (the batch-1 step's kernels)
#   tests: the spec-decode tests and the CUDA-graph tests on CUDA (real graphs,
#          Triton attention compiled); SmolLM2's tokenizer from $ASYNCSTEP_TEST_TOKENIZER
#          (default .tok: `save_pretrained` of the embedded model's tokenizer)
# BENCH_ARGS (default --sync --profile), TAG (file suffix), BENCH_TIMEOUT, TESTS_TIMEOUT,
# PROFILE_CASES (shape:packing ...) change the stages.
# Output (text and JSON) goes to $OUT (default benchmarks/results/spec_decode).
set -u
OUT=${OUT:-benchmarks/results/spec_decode}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run_bench() {
    timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/studies/spec_decode/spec_decode_gpu.py --shape llama-8b --k 3 4 \
        --prompt-len 512 --output-len 256 --repeats 3 ${BENCH_ARGS:---sync --profile} \
        --out "$OUT/spec_llama-8b_b1${TAG:-}.json" 2>&1 | tee "$OUT/spec_llama-8b_b1${TAG:-}.txt" \
        | grep -vi warn
}
run_tests() {
    ASYNCSTEP_TEST_DEVICE=cuda ASYNCSTEP_TEST_TOKENIZER=${ASYNCSTEP_TEST_TOKENIZER:-$PWD/.tok} \
        timeout -s INT ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rs \
        tests/engine/test_spec_decode.py tests/engine/test_spec_decode_engine.py tests/runner/test_cudagraph.py \
        tests/gpu/test_triton_attention.py tests/runner/test_sampler.py \
        > "$OUT/gpu_tests_spec_h200.txt" 2>&1
    tail -8 "$OUT/gpu_tests_spec_h200.txt"
}
run_profile() {
    for case in ${PROFILE_CASES:-llama-8b:none llama-1b:none llama-8b:q4}; do
        IFS=: read -r shape packing <<< "$case"
        timeout 90 python3 benchmarks/studies/decode_kernels/quant_step_kernels.py --shape "$shape" --packing "$packing" \
            > "$OUT/step_kernels_${shape}_$packing.txt" 2>&1
        grep -v Warn "$OUT/step_kernels_${shape}_$packing.txt" | head -14
    done
}
case "$1" in
bench) run_bench ;;
tests) run_tests ;;
profile) run_profile ;;
all) run_bench; run_tests; run_profile ;;
esac
