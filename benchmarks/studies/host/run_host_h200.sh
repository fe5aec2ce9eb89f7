#!/usr/bin/env bash
# The host-path measurements (issue 13) on one H200, one stage per device call:
#     bash benchmarks/studies/host/run_host_h200.sh throughput|decode|latency8b|tests
# Variants: proc = the engine core in its own process, the runner on a launch
# thread; inproc = all in the caller's process (as before this issue); inline
# = the core in its own process, the runner's calls on its event loop (no
# launch thread; the default on CUDA since these runs). Output to $OUT
# (default benchmarks/results/host).
set -u
OUT=${OUT:-benchmarks/results/host}
mkdir -p "$OUT"
BENCH="python3 -m asyncstep bench"
VARIANTS=("proc:--no-launch-inline" "inproc:--no-engine-process --no-launch-inline" "inline:--launch-inline")
case "$1" in
throughput)  # llama-1b, 256 random requests (100-1024 in / out), GPU busy from the spans
    for v in "${VARIANTS[@]}"; do
        name=${v%%:*}
        timeout 170 $BENCH throughput --load-format dummy --model llama-1b --no-hf ${v#*:} \
            --output-json "$OUT/throughput_llama-1b_$name.json" 2>&1 | grep -E "tok/s|busy|256" | tail -4
    done ;;
decode)  # steady decode at batch 1, 32 and 256: device vs wall ITL, busy, spans per step
    for v in "${VARIANTS[0]}" "${VARIANTS[2]}"; do
        name=${v%%:*}
        timeout 250 python3 benchmarks/studies/overlap/overlap_decode.py --shape llama-1b --batch 1 32 256 \
            --output-len 64 --repeats 1 --overlap-only --summary ${v#*:} \
            --out "$OUT/decode_llama-1b_$name.json" 2>&1 | tee "$OUT/decode_llama-1b_$name.txt" \
            | grep -E "^batch"
    done ;;
latency8b)  # no slower than before (4.70 / 5.41 ms); HF quoted from the fast-path run
    for v in "${VARIANTS[2]}" "${VARIANTS[1]}"; do
        name=${v%%:*}
        timeout 240 $BENCH latency --num-iters 1 --load-format dummy --model llama-8b --batch-size 1 32 --input-len 128 \
            --output-len 64 --no-hf ${v#*:} --output-json "$OUT/latency_llama-8b_$name.json" 2>&1 | tail -6
    done ;;
tests)
    ASYNCSTEP_TEST_DEVICE=cuda timeout 280 python3 -m pytest -q -p no:cacheprovider -x \
        tests/engine/test_engine_process.py tests/engine/test_engine.py tests/gpu/test_gpu.py tests/engine/test_stream.py \
        > "$OUT/gpu_tests_h200.txt" 2>&1
    tail -5 "$OUT/gpu_tests_h200.txt" ;;
*)
    echo "unknown stage $1" >&2; exit 2 ;;
esac
