#!/usr/bin/env bash
# The MoE models (issue 41) on one GPU (the device tool's nvidia-h200 or nvidia-h100-x1):
#     bash benchmarks/studies/moe/run_moe_h200.sh tests|kernels|latency|throughput|groups|moefast|all
#   tests:      tests/gpu/test_fused_moe.py and test_triton_sliding_window.py compiled for
#               the GPU (bfloat16 rounds to nearest there)
#   kernels:    benchmarks/studies/moe/fused_moe_kernel.py --tiles (the kernel against the
#               torch loop and the floor, qwen3-30b-a3b and gpt-oss-20b shapes, T = 1, 32, 256)
#   latency:    qwen3-30b-a3b and gpt-oss-20b (dummy weights, bf16): batch 1 and 32, ITL
#               against HF generate (eager: its expert loop does not compile whole) and the
#               floor (the bytes a step reads: dense weights, the experts its tokens pick)
#   throughput: the same two models, 256 requests (prompts 256..768, outputs 128..384), and
#               the floor
#   groups:     CUDA graphs of several KV cache groups (gpt-oss-20b: 2, gemma3-1b: 13):
#               tests/gpu/test_real_graphs_kv_groups.py (real graphs against eager tokens),
#               then batch 1 and 32 ITL with graphs (FULL_AND_PIECEWISE) and the floor, and
#               gemma3-1b's without graphs beside it (gpt-oss-20b's: the latency mode, or
#               BASELINE=1 here); under 5 min with the timeouts below (295 s)
#   all:        tests, latency, throughput (under 10 min with the timeouts below)
#   moefast:    the routing / alignment kernels and the small-T path (issue 41, under 5 min):
#               tests/gpu/test_moe_routing.py and test_fused_moe.py compiled for the GPU;
#               fused_moe_kernel.py --routing --gemv-tiles at T = 1..32 (grouped GEMM against
#               small-T in CUDA graphs, the floor, the threshold line; torch-op routing against
#               the kernels); qwen3-30b-a3b ITL at batch 1 and 32 (dummy weights, no HF)
# Dependencies: run `bash ../shared/device/wheels.sh` once here and carry ".whl".
# Output (text and JSON) goes to $OUT (default benchmarks/results/moe). A dry run of the
# commands on the CPU: MODELS=/path/to/tiny-moe DEVICE=cpu PROMPTS=4 bash ... latency
set -u
OUT=${OUT:-benchmarks/results/moe}
mkdir -p "$OUT"
export PYTHONPATH="$HOME/site:$PWD"
if ! python3 -c "import trio, structlog, msgspec, gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$HOME/site" .whl/*.whl || exit 1
fi
BENCH="python3 -m asyncstep bench"
MODELS=${MODELS:-qwen3-30b-a3b gpt-oss-20b}
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-256}
FORMAT=$([ "$DEVICE" = cpu ] && echo auto || echo dummy)
machine() {
    {
        date -u
        git rev-parse --short HEAD 2>/dev/null
        nvidia-smi 2>/dev/null --query-gpu=name,memory.total,driver_version --format=csv,noheader
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    } > "$OUT/machine.txt" 2>&1
    cat "$OUT/machine.txt"
}
run_tests() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_fused_moe.py tests/gpu/test_triton_sliding_window.py > "$OUT/gpu_tests_moe.txt" 2>&1
    tail -4 "$OUT/gpu_tests_moe.txt"
}
run_kernels() {
    timeout 200 python3 benchmarks/studies/moe/fused_moe_kernel.py --tiles --out "$OUT/fused_moe_kernel.json" \
        2>&1 | grep -vi warn > "$OUT/fused_moe_kernel.txt"
    cat "$OUT/fused_moe_kernel.txt"
}
run_latency() {
    for model in $MODELS; do
        name=$(basename "$model")
        timeout ${LATENCY_TIMEOUT:-260} $BENCH latency --hf --no-hf-compile --hf-warmups 1 --hf-repeats 1 \
            --load-format $FORMAT --model "$model" --device $DEVICE \
            --batch-size 1 32 --input-len 128 --output-len 64 --num-iters 2 \
            --max-model-len 2048 --output-json "$OUT/latency_$name.json" \
            > "$OUT/latency_$name.txt" 2>&1
        echo "$name"; grep -E "ours b|HF |failed|Error|│ +[0-9]" "$OUT/latency_$name.txt"
    done
}
run_throughput() {
    for model in $MODELS; do
        name=$(basename "$model")
        timeout ${THROUGHPUT_TIMEOUT:-120} $BENCH throughput --no-hf --load-format $FORMAT \
            --model "$model" --device $DEVICE --num-prompts $PROMPTS --input-len 512 \
            --output-len 256 --range-ratio 0.5 --max-model-len 2048 \
            --output-json "$OUT/throughput_$name.json" > "$OUT/throughput_$name.txt" 2>&1
        echo "$name"; grep -E "ours n|failed|Error|│ +[0-9]" "$OUT/throughput_$name.txt"
    done
}
group_latency() {  # model, cudagraph mode, timeout
    timeout "$3" $BENCH latency --no-hf --load-format $FORMAT --model "$1" --device $DEVICE \
        --batch-size 1 32 --input-len 128 --output-len 64 --num-iters 2 --max-model-len 2048 \
        --cudagraph-mode "$2" --cudagraph-capture-sizes 1 2 4 8 16 24 32 64 128 256 \
        --output-json "$OUT/groups_$1_$2.json" > "$OUT/groups_$1_$2.txt" 2>&1
    echo "$1 $2"; grep -E "ours b|failed|Error|│ +[0-9]" "$OUT/groups_$1_$2.txt"
}
run_groups() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout ${TESTS_TIMEOUT:-100} python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_real_graphs_kv_groups.py > "$OUT/gpu_tests_kv_groups.txt" 2>&1
    tail -3 "$OUT/gpu_tests_kv_groups.txt"
    group_latency gpt-oss-20b FULL_AND_PIECEWISE 110
    [ "${BASELINE:-0}" = 1 ] && group_latency gpt-oss-20b NONE 110
    group_latency gemma3-1b FULL_AND_PIECEWISE 45
    group_latency gemma3-1b NONE 40
}
run_moefast() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout 70 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_moe_routing.py tests/gpu/test_fused_moe.py > "$OUT/gpu_tests_moefast.txt" 2>&1
    tail -4 "$OUT/gpu_tests_moefast.txt"
    timeout 140 python3 benchmarks/studies/moe/fused_moe_kernel.py --routing --gemv-tiles \
        --tokens 1 2 4 8 16 32 --out "$OUT/moefast_kernel.json" 2>&1 | grep -vi warn \
        > "$OUT/moefast_kernel.txt"
    cat "$OUT/moefast_kernel.txt"
    timeout 90 $BENCH latency --load-format dummy --model qwen3-30b-a3b --device cuda \
        --batch-size 1 32 --input-len 128 --output-len 64 --num-iters 2 --max-model-len 2048 \
        --output-json "$OUT/latency_moefast.json" > "$OUT/latency_moefast.txt" 2>&1
    echo qwen3-30b-a3b; grep -E "ours b|failed|Error|│ +[0-9]" "$OUT/latency_moefast.txt"
}
machine
case "${1:-all}" in
tests) run_tests ;;
kernels) run_kernels ;;
latency) run_latency ;;
throughput) run_throughput ;;
groups) run_groups ;;
moefast) run_moefast ;;
all) run_tests; run_latency; run_throughput ;;
*) echo "usage: $0 tests|kernels|latency|throughput|groups|moefast|all" >&2; exit 2 ;;
esac
