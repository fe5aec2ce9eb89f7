#!/usr/bin/env bash
# Issue 43's greedy argmax inside the FULL decode graph, on one GPU, each
# stage in one device call (output to $OUT, default
# benchmarks/results/host/greedy-graph):
#     bash benchmarks/studies/host/run_greedy_graph_h200.sh latency|profile|tests
# latency: llama-1b bf16 (dummy weights), 128-token prompts, 64 tokens, batch
#   1 and 32, greedy_in_graph off then on then off (one engine each; at most
#   4.5 min); profile: cProfile of the runner's calls at batch 1, off and on
#   (at most 1.5 min); tests: tests/gpu/test_greedy_graph_cuda.py and the CPU
#   tests on CUDA (at most 2 min).
set -u
OUT=${OUT:-benchmarks/results/host/greedy-graph}
mkdir -p "$OUT"
BENCH="python3 -m asyncstep bench latency --load-format dummy --model llama-1b --batch-size 1 32 --input-len 128 --output-len 64 --num-iters 3 --no-hf --no-batch-invariant"
latency() {
    nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt"
    for run in off_1:--no-greedy-in-graph on:--greedy-in-graph off_2:--no-greedy-in-graph; do
        name=${run%%:*}
        timeout 90 $BENCH ${run#*:} --output-json "$OUT/latency_llama-1b_$name.json" \
            > "$OUT/latency_llama-1b_$name.txt" 2>&1
        echo "== $name (rc $?)"; tail -6 "$OUT/latency_llama-1b_$name.txt"
    done
}
profile() {
    for flag in no-greedy-in-graph greedy-in-graph; do
        timeout 45 python3 benchmarks/studies/overlap/profile_decode.py --shape llama-1b --batch 1 \
            --$flag --no-batch-invariant --top 40 > "$OUT/profile_llama-1b_b1_$flag.txt" 2>&1
        echo "== $flag (rc $?)"; head -3 "$OUT/profile_llama-1b_b1_$flag.txt"
    done
}
tests() {
    ASYNCSTEP_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_greedy_graph_cuda.py tests/runner/test_greedy_graph.py > "$OUT/gpu_tests.txt" 2>&1
    tail -5 "$OUT/gpu_tests.txt"
}
case "${1:-}" in
latency) latency ;;
profile) profile ;;
tests) tests ;;
*) echo "unknown stage $1" >&2; exit 2 ;;
esac
