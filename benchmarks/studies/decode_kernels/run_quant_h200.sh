#!/usr/bin/env bash
# Q4 weights on the GPU (issue 28), on one H200 (the device tool's nvidia-h200):
#     bash benchmarks/studies/decode_kernels/run_quant_h200.sh tests|kernels|latency
#   tests:   the Q4 kernels' tests compiled for the GPU, and a whole engine on a
#            4-bit tiny model against its dense twin
#   kernels: benchmarks/studies/decode_kernels/quant_gpu.py on llama-8b's linear layers at one row (bf16
#            against every Q4 GEMV launch) and its LM head (bf16 against Q8)
#   latency: llama-8b ITL at batch 1 and 32, bf16 weights then Q4 (dummy
#            weights rounded to Q4_1's grid, the LM head to Q8_0's:
#            weight_packing=q4), one machine
# Output (text and JSON) goes to $OUT (default benchmarks/results/quant_gpu).
set -u
OUT=${OUT:-benchmarks/results/quant_gpu}
mkdir -p "$OUT"
LATENCY="python3 -m asyncstep bench latency --no-hf --load-format dummy --model llama-8b --batch-size 1 32"
LATENCY="$LATENCY --input-len 128 --output-len 64 --num-iters 1"
case "$1" in
tests)
    ASYNCSTEP_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_triton_quant.py > "$OUT/gpu_tests_h200.txt" 2>&1
    tail -5 "$OUT/gpu_tests_h200.txt" ;;
kernels)
    timeout 330 python3 benchmarks/studies/decode_kernels/quant_gpu.py --rows 1 --lm-head --replays 20 \
        --out "$OUT/kernels_llama-8b.json" 2>&1 | tee "$OUT/kernels_llama-8b.txt" | tail -12 ;;
latency)
    for packing in none q4; do
        timeout 250 $LATENCY --weight-packing $packing \
            --output-json "$OUT/latency_llama-8b_$packing.json" > "$OUT/latency_llama-8b_$packing.txt" 2>&1
        grep -E "ours b|│ +[0-9]|bandwidth" "$OUT/latency_llama-8b_$packing.txt"
    done ;;
esac
