#!/usr/bin/env bash
# What batch invariance costs on one H200 (issue 40; the device tool's nvidia-h200),
# and whether it holds there:
#     bash benchmarks/studies/invariance/gpu_cost.sh all|tests|latency|throughput|probe|kernels|matmul|matmul-1b|tiles|step-kernels
#   tests:      tests/gpu/test_triton_invariant.py compiled for the GPU (float32 and
#               bfloat16: the kernels' rows bit for bit in any batch)
#   latency:    llama-8b (dummy weights, bf16) ITL at batch 1 and 32, batch_invariant off, on
#   throughput: llama-1b 256 requests (prompts 256..768 tokens, outputs 128..384), off, on
#   probe:      gpu_probe.py on llama-1b: 8 prompts alone against among 32 others, greedy,
#               tokens and log-probs bit for bit, off and on, without and with n-gram
#               speculation (and speculation's tokens against plain decoding's)
#   kernels:    gpu_kernels.py: the invariant matmul and attention against the fast kernels,
#               kernel by kernel (llama-8b's shapes; the attention at 64, 128, 256 keys a
#               split; not in all, under 3 minutes)
#   matmul:     gpu_matmul.py: the invariant matmul (split launch, unsplit) against F.linear,
#               the one-row GEMV and the HBM floor at llama-8b's shapes, M = 1, 8, 32, 256,
#               2048, in CUDA graphs; a sweep of the split's constants; row 0's bits at every
#               M by each launch (not in all; under 4 minutes)
#   matmul-1b:  the same at llama-1b's shapes, no sweep (under 2 minutes)
#   tiles:      gpu_matmul.py --tile-sweep: every (BLOCK_N, BLOCK_K, warps, TARGET_PROGRAMS,
#               stages) at llama-8b's four layer shapes, M = 1, 32, 2048 (under 7 minutes)
#   step-kernels: quant_step_kernels.py, llama-8b batch ${BATCH:-1}, batch_invariant off / on,
#               ASYNCSTEP_PDL=0 (a kernel's time is then its own; under 5 minutes)
#   all:        the first four, under 10 minutes (the steps' timeouts: 120 + 2 x 85 + 2 x 75
#               + 100 s)
# Dependencies: run `bash ../shared/device/wheels.sh` once here and carry ".whl"; this
# script installs them where python cannot import them. Output: one text file a step in
# $OUT (default benchmarks/results/invariance_gpu), JSON in /tmp (the device tool
# brings back a few files only). A dry run on the CPU (every command, tiny shapes):
#     BIG=tiny-llama SMALL=tiny-llama DEVICE=cpu PROMPTS=4 bash benchmarks/studies/invariance/gpu_cost.sh all
set -u
OUT=${OUT:-benchmarks/results/invariance_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$HOME/site:$PWD"
if ! python3 -c "import trio, structlog, msgspec, gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$HOME/site" .whl/*.whl || exit 1
fi
BENCH="python3 -m asyncstep bench"
BIG=${BIG:-llama-8b}
SMALL=${SMALL:-llama-1b}
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-256}
inv_flag() { [ "$1" = on ] && echo --batch-invariant || echo --no-batch-invariant; }
machine() {
    {
        date -u
        git rev-parse --short HEAD 2>/dev/null
        nvidia-smi 2>/dev/null --query-gpu=name,memory.total,driver_version --format=csv,noheader
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
        lscpu | grep -E "Model name|^Flags" | cut -c1-400
    } > "$OUT/machine.txt" 2>&1
}
run_tests() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_triton_invariant.py > "$OUT/gpu_tests.txt" 2>&1
    tail -4 "$OUT/gpu_tests.txt"
}
run_latency() {
    for inv in off on; do
        timeout 85 $BENCH latency --no-hf --no-floor --load-format dummy --model $BIG --device $DEVICE \
            --batch-size 1 32 --input-len 128 --output-len 64 --num-iters 1 \
            --max-model-len 2048 --cudagraph-capture-sizes 1 2 4 8 16 32 64 \
            $(inv_flag $inv) --output-json "/tmp/latency_llama-8b_$inv.json" \
            > "$OUT/latency_llama-8b_$inv.txt" 2>&1
        echo "batch_invariant=$inv"; grep -E "ours b|│ +[0-9]" "$OUT/latency_llama-8b_$inv.txt"
    done
}
run_throughput() {
    for inv in off on; do
        timeout 75 $BENCH throughput --no-hf --no-floor --no-gpu-busy --load-format dummy \
            --model $SMALL --device $DEVICE --num-prompts $PROMPTS --input-len 512 --output-len 256 \
            --range-ratio 0.5 --max-model-len 2048 \
            $(inv_flag $inv) --output-json "/tmp/throughput_llama-1b_$inv.json" \
            > "$OUT/throughput_llama-1b_$inv.txt" 2>&1
        echo "batch_invariant=$inv"; grep -E "ours n|│ +[0-9]" "$OUT/throughput_llama-1b_$inv.txt"
    done
}
run_kernels() {
    timeout 150 python3 benchmarks/studies/invariance/gpu_kernels.py --device $DEVICE \
        $([ "$DEVICE" = cpu ] && echo --tiny) > "$OUT/kernels.txt" 2>&1
    cat "$OUT/kernels.txt"
}
run_matmul() {  # $1: the model, $2: extra arguments, $3: the timeout
    timeout $3 python3 benchmarks/studies/invariance/gpu_matmul.py --device $DEVICE --model $1 \
        $2 $([ "$DEVICE" = cpu ] && echo --tiny) > "$OUT/matmul_$1.txt" 2>&1
    echo "rc=$?"; cat "$OUT/matmul_$1.txt"
}
run_tiles() {  # the tile sweep (gpu_matmul.py --tile-sweep), llama-8b's four layer shapes
    timeout 420 python3 benchmarks/studies/invariance/gpu_matmul.py --device $DEVICE --model $BIG \
        --tile-sweep $([ "$DEVICE" = cpu ] && echo --tiny) > "$OUT/tiles_$BIG.txt" 2>&1
    echo "rc=$?"; cat "$OUT/tiles_$BIG.txt"
}
run_step_kernels() {  # a decode step's kernels, batch_invariant off / on, PDL off (honest times)
    for inv in off on; do
        ASYNCSTEP_PDL=0 timeout 140 python3 benchmarks/studies/decode_kernels/quant_step_kernels.py \
            --shape $BIG --packing none --batch ${BATCH:-1} --tokens 64 --top 30 \
            $(inv_flag $inv) > "$OUT/step_kernels_${BIG}_b${BATCH:-1}_$inv.txt" 2>&1
        echo "rc=$?"; grep -v Warning "$OUT/step_kernels_${BIG}_b${BATCH:-1}_$inv.txt" | head -40
    done
}
run_probe() {
    timeout 100 python3 benchmarks/studies/invariance/gpu_probe.py --model $SMALL --device $DEVICE \
        > "$OUT/probe_llama-1b.txt" 2>&1
    grep -E "^model=|batch_invariant|Error" "$OUT/probe_llama-1b.txt"
}
machine
case "${1:-all}" in
tests) run_tests ;;
latency) run_latency ;;
throughput) run_throughput ;;
probe) run_probe ;;
kernels) run_kernels ;;
matmul) run_matmul llama-8b "" 220 ;;
matmul-1b) run_matmul llama-1b --no-sweep 120 ;;
tiles) run_tiles ;;
step-kernels) run_step_kernels ;;
all) run_tests; run_latency; run_throughput; run_probe ;;
*) echo "usage: $0 all|tests|latency|throughput|probe|kernels|matmul|matmul-1b|tiles|step-kernels" >&2; exit 2 ;;
esac
