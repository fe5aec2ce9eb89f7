#!/usr/bin/env bash
# The one-row GEMV of dense 16-bit weights (issue 28) on one H200 (the device tool's nvidia-h200):
#     bash benchmarks/studies/decode_kernels/run_gemv_h200.sh tests|kernels|latency|all|profile32|latency32
#   tests:   tests/gpu/test_triton_gemv.py, tests/models/test_fused_decode.py (whole engines,
#            fused decode on and off) and tests/runner/test_cudagraph.py compiled for the GPU
#   kernels: benchmarks/studies/decode_kernels/dense_gemv.py (cuBLAS against the Triton GEMV's launches), llama-8b, 1b
#   latency: bf16 ITL at batch 1, fused decode (the GEMV among it) on, then off: llama-8b, llama-1b
#   profile32: the bf16 llama-8b batch-32 decode step's kernels (benchmarks/studies/decode_kernels/quant_step_kernels.py)
#   latency32: bf16 llama-8b ITL at batch 32, fused decode on, then off
# Output (text and JSON) goes to $OUT (default benchmarks/results/fused_decode).
set -u
OUT=${OUT:-benchmarks/results/fused_decode}
mkdir -p "$OUT"
LATENCY="python3 -m asyncstep bench latency --no-hf --no-batch-invariant --load-format dummy --batch-size 1"
LATENCY="$LATENCY --input-len 128 --output-len 64 --num-iters 1 --weight-packing none"
run_tests() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_triton_gemv.py tests/models/test_fused_decode.py tests/runner/test_cudagraph.py \
        > "$OUT/gpu_tests_gemv_h200.txt" 2>&1
    tail -4 "$OUT/gpu_tests_gemv_h200.txt"
}
run_kernels() {
    for shape in llama-8b llama-1b; do
        timeout 100 python3 benchmarks/studies/decode_kernels/dense_gemv.py --shape $shape --out "/tmp/dense_gemv_$shape.json" \
            2>&1 | grep -vi warn > "$OUT/dense_gemv_$shape.txt"
        tail -5 "$OUT/dense_gemv_$shape.txt"
    done
}
run_latency() {
    for case in llama-8b:on llama-8b:off llama-1b:on llama-1b:off; do
        IFS=: read -r model fused <<< "$case"
        flag=$([ "$fused" = on ] && echo --fused-decode || echo --no-fused-decode)
        timeout 150 $LATENCY --model "$model" $flag --output-json "/tmp/latency_${model}_$fused.json" \
            > "$OUT/latency_gemv_${model}_$fused.txt" 2>&1
        echo "$model fused_decode $fused"
        grep -E "│ +[0-9]|bandwidth" "$OUT/latency_gemv_${model}_$fused.txt"
    done
}
run_profile32() {
    for fused in on off; do
        flag=$([ "$fused" = on ] || echo --no-fused-decode)
        timeout 150 python3 benchmarks/studies/decode_kernels/quant_step_kernels.py --shape llama-8b --packing none --no-batch-invariant --batch 32 \
            $flag --top 20 --out "$OUT/step_kernels_b32_$fused.json" 2>&1 | grep -vi warn > "$OUT/step_kernels_b32_$fused.txt"
        cat "$OUT/step_kernels_b32_$fused.txt"
    done
}
run_latency32() {
    for fused in on off; do
        flag=$([ "$fused" = on ] && echo --fused-decode || echo --no-fused-decode)
        timeout 150 ${LATENCY/--batch-size 1/--batch-size 32} --model llama-8b $flag \
            --output-json "/tmp/latency32_$fused.json" > "$OUT/latency32_llama-8b_$fused.txt" 2>&1
        echo "llama-8b batch 32 fused_decode $fused"
        grep -E "│ +[0-9]|bandwidth" "$OUT/latency32_llama-8b_$fused.txt"
    done
}
case "$1" in
tests) run_tests ;;
kernels) run_kernels ;;
latency) run_latency ;;
all) run_tests; run_latency ;;
profile32) run_profile32 ;;
latency32) run_latency32 ;;
esac
