#!/usr/bin/env bash
# The split-KV decode attention's launch on one H200 (the device tool's nvidia-h200), issue 28:
#     bash benchmarks/studies/decode_kernels/run_attention_h200.sh sweep
#   sweep: benchmarks/studies/fastpath/attention_kernel.py at llama-8b's heads, batch 1 and 32, a 160-key context
#          (the latency runs' middle) and 1024, 8 distinct caches in the graph, the default launch
#          and each override in SWEEP (splits, key tile, warps, stages; commas join several)
# Output (text and JSON) goes to $OUT (default benchmarks/results/fused_decode/attention).
set -u
OUT=${OUT:-benchmarks/results/fused_decode/attention}
mkdir -p "$OUT"
SWEEP=${SWEEP:-"default --num-splits=1 --num-splits=2 --num-splits=4 --num-splits=8 --tile-n=32 --tile-n=16 --num-warps=2 --num-warps=8 --num-stages=1 --num-stages=2 --num-stages=4"}
run_sweep() {
    for case in $SWEEP; do
        over=$([ "$case" = default ] || echo "${case//,/ }")
        tag=$(echo "$case" | tr -c 'a-z0-9\n' '_')
        timeout 100 python3 benchmarks/studies/fastpath/attention_kernel.py --batches ${BATCHES:-1 32} --contexts ${CONTEXTS:-160 1024} \
            --layers 8 --iters 50 $over --out "$OUT/attention_$tag.json" 2>&1 | grep -vi warn > "$OUT/attention_$tag.txt"
        cat "$OUT/attention_$tag.txt"
    done
}
case "$1" in
sweep) run_sweep ;;
esac
