#!/usr/bin/env bash
# Issue 43 on main, on one H200 (the device tool's nvidia-h200), one device call of at
# most 8 minutes (every step under `timeout`; the figures first, then the tests):
#     bash benchmarks/studies/q4_packed/run_q4_optin_h200.sh [wheels] [latency] [tests]
#   (no step named: all three, in that order)
#   wheels:  the pure-Python wheels the GPU image lacks, from ./.whl (made here by
#            ../shared/device/wheels.sh; the device call carries ".whl"), into
#            $HOME/site, which PYTHONPATH then leads with
#   latency: $MODEL (default llama-8b) batch-1 ITL on dummy weights, one run per case of
#            $CASES (PACKING:ACTIVATIONS; default: Q4 float, Q4 int8, bf16 dense, Q4 int8,
#            Q4 float: the Q4 pair twice, alternating), each row with the bench's floor
#            (the bytes the step reads, Q4 + Q8 head + KV, over the copy bandwidth) and
#            ITL/floor; a summary line per case in $OUT/latency.txt
#   tests:   the GPU tests: tests/gpu and tests/models/test_fused_decode.py
#            (ASYNCSTEP_TEST_DEVICE=cuda), into $OUT/gpu_tests.txt
# ACTIVATIONS: --gpu-q4-activations (float: the default; int8: opt-in). PDL stays at its
# default (on; ASYNCSTEP_PDL=0 in the environment turns it off for every case).
# Time: the whole script stops within $BUDGET seconds (default 470): each step's timeout
# is the smaller of its own (wheels 30 s, a latency run 90 s) and what is left; the tests
# get what is left.
# $OUT: the device tool's folder (default /tmp/q4_optin). DEVICE_FLAGS: extra engine flags
# (the CPU dry run: MODEL=tiny-llama DEVICE_FLAGS="--device cpu").
set -u
START=$(date +%s)
BUDGET=${BUDGET:-470}
# The seconds a step may take: its own limit ($1), or what is left of the budget (at least 1).
limit() {
    local left=$((BUDGET - ($(date +%s) - START)))
    [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"
}
OUT=${OUT:-/tmp/q4_optin}
mkdir -p "$OUT"
MODEL=${MODEL:-llama-8b}
LATENCY="python3 -m asyncstep bench latency --no-hf --load-format dummy --model $MODEL"
LATENCY="$LATENCY --batch-size 1 --input-len 128 --output-len 64 --num-iters 1 ${DEVICE_FLAGS:-}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(wheels latency tests)
for step in "${steps[@]}"; do
    echo "== $step $(date -u +%FT%TZ)" | tee -a "$OUT/steps.txt"
    case "$step" in
    wheels)
        timeout "$(limit 30)" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$HOME/site" .whl/*.whl 2>&1 | tee "$OUT/wheels.txt"
        export PYTHONPATH="$HOME/site:$PWD" ;;
    latency)
        for case in ${CASES:-q4:float q4:int8 none:float q4:int8 q4:float}; do
            IFS=: read -r packing activations <<< "$case"
            tag=${packing}_${activations}
            n=$(ls "$OUT" | grep -c "^latency_${MODEL}_${tag}")
            file="$OUT/latency_${MODEL}_${tag}_$n.txt"
            timeout "$(limit 90)" $LATENCY --weight-packing "$packing" --gpu-q4-activations "$activations" \
                --output-json "/tmp/latency_${tag}_$n.json" > "$file" 2>&1
            echo "rc=$? weight_packing=$packing gpu_q4_activations=$activations: $(grep -E 'ours b' "$file")" \
                | tee -a "$OUT/latency.txt"
            grep -E "│ +[0-9]|bandwidth" "$file" | tee -a "$OUT/latency.txt"
        done ;;
    tests)
        ASYNCSTEP_TEST_DEVICE=cuda timeout "$(limit "$BUDGET")" python3 -m pytest -q -p no:cacheprovider -rs \
            tests/gpu tests/models/test_fused_decode.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -12 ;;
    *)
        echo "unknown step $step" ;;
    esac
done
