#!/usr/bin/env bash
# The fused decode (issue 28) on one H200 (the device tool's nvidia-h200):
#     bash benchmarks/studies/decode_kernels/run_fused_h200.sh tests|latency|profile|all
#   tests:   tests/models/test_fused_decode.py and tests/gpu/test_triton_quant.py compiled
#            for the GPU (a whole engine on a 4-bit model, fused decode on and off)
#   latency: llama-8b ITL at batch 1, Q4 (weight_packing=q4) with the fused
#            decode on, then off, then bf16 weights on and off: one machine, one
#            after another; then llama-1b bf16 on and off (latency_llama-1b.txt)
#   profile: benchmarks/studies/decode_kernels/quant_step_kernels.py (the batch-1 step's kernels) of
#            the Q4 model, fused decode on, then off
#   kernels: benchmarks/studies/decode_kernels/fused_gemv.py (a layer's linear part, unfused against fused)
#   all:     tests, latency, profile (fused decode on only)
# At most 8 files come back from the device tool: the JSON goes to /tmp.
# Output (text and JSON) goes to $OUT (default benchmarks/results/fused_decode).
set -u
OUT=${OUT:-benchmarks/results/fused_decode}
mkdir -p "$OUT"
LATENCY="python3 -m asyncstep bench latency --no-hf --no-batch-invariant --load-format dummy --model llama-8b --batch-size 1"
LATENCY="$LATENCY --input-len 128 --output-len 64 --num-iters 1"
fused_flag() { [ "$1" = true ] && echo --fused-decode || echo --no-fused-decode; }
run_tests() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
        tests/models/test_fused_decode.py tests/gpu/test_triton_quant.py > "$OUT/gpu_tests_h200.txt" 2>&1
    tail -4 "$OUT/gpu_tests_h200.txt"
}
run_latency() {
    for case in q4_fused:q4:true q4_unfused:q4:false bf16:none:true bf16_unfused:none:false; do
        IFS=: read -r name packing fused <<< "$case"
        timeout 170 $LATENCY --weight-packing "$packing" \
            $(fused_flag "$fused") \
            --output-json "/tmp/latency_$name.json" \
            > "$OUT/latency_$name.txt" 2>&1
        grep -E "ours b|│ +[0-9]|bandwidth" "$OUT/latency_$name.txt"
    done
    for fused in true false; do
        echo "llama-1b bf16 fused_decode=$fused"
        timeout 120 ${LATENCY/llama-8b/llama-1b} $(fused_flag "$fused") \
            --output-json "/tmp/latency_llama-1b_$fused.json" 2>&1
    done > "$OUT/latency_llama-1b.txt"
    grep -E "fused_decode|ours b|│ +[0-9]" "$OUT/latency_llama-1b.txt"
}
run_profile() {
    for fused in ${PROFILE_CASES:-on off}; do
        flag=$([ "$fused" = off ] && echo --no-fused-decode)
        timeout 150 python3 benchmarks/studies/decode_kernels/quant_step_kernels.py --packing q4 $flag \
            --out "/tmp/step_kernels_q4_$fused.json" > "$OUT/step_kernels_q4_$fused.txt" 2>&1
        head -20 "$OUT/step_kernels_q4_$fused.txt"
    done
}
run_kernels() {
    timeout 120 python3 benchmarks/studies/decode_kernels/fused_gemv.py --out /tmp/fused_gemv.json \
        > "$OUT/fused_gemv_llama-8b.txt" 2>&1
    cat "$OUT/fused_gemv_llama-8b.txt"
}
case "$1" in
tests) run_tests ;;
kernels) run_kernels ;;
latency) run_latency ;;
profile) run_profile ;;
all) run_tests; run_latency; PROFILE_CASES=on run_profile ;;
esac
