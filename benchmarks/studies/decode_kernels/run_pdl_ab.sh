#!/usr/bin/env bash
# Programmatic dependent launch on every decode kernel (issues 41 and 43), one GPU:
# base (a tree without the change: BASE, default /tmp/pdl_base, unpacked from
# $BASE_TGZ when given) against this tree, alternated, one process a run:
#     BASE_TGZ=base.tgz bash benchmarks/studies/decode_kernels/run_pdl_ab.sh tests|ab|profile
#   tests:   the Triton op tests compiled for the GPU (ASYNCSTEP_TEST_DEVICE=cuda), the
#            PDL chain's bits first
#   ab:      asyncstep bench latency (dummy weights, 128-token prompts, 64 tokens, batch 1
#            and 32) for each of $MODELS, base then new, $ROUNDS rounds; the dense models
#            with --no-batch-invariant (the fast op set's GEMV) unless NO_BI is empty
#   profile: quant_step_kernels.py per model at batch $PROFILE_BATCH (default 1), this
#            tree, PDL off and on ($PDLS, default "0 1")
#   invariant: this tree's batch-invariant op set against its fast one ($MODELS, batch 1
#            and 32, alternated, $ROUNDS rounds): the cost of CUDA's default (issue 40)
# Output (text and JSON) goes to $OUT (default benchmarks/results/pdl).
set -u
OUT=${OUT:-benchmarks/results/pdl}
BASE=${BASE:-/tmp/pdl_base}
MODELS=${MODELS:-qwen3-30b-a3b llama-1b}
ROUNDS=${ROUNDS:-2}
NO_BI=${NO_BI---no-batch-invariant}
NEW=$PWD
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if ! python3 -c "import trio, structlog, msgspec, gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$HOME/site" .whl/*.whl || exit 1
fi
if [ -n "${BASE_TGZ:-}" ] && [ ! -d "$BASE/asyncstep" ]; then
    mkdir -p "$BASE" && tar -xzf "$BASE_TGZ" -C "$BASE" || exit 1
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

run_tests() {
    ASYNCSTEP_TEST_DEVICE=cuda PYTHONPATH="$HOME/site:$NEW" timeout 420 python3 -m pytest -q \
        -p no:cacheprovider tests/gpu/test_pdl_chain.py tests/gpu/test_triton_gemv.py \
        tests/gpu/test_triton_fused.py tests/gpu/test_moe_routing.py tests/gpu/test_fused_moe.py \
        > "$OUT/gpu_tests.txt" 2>&1
    tail -4 "$OUT/gpu_tests.txt"
}

latency() {  # tree name model round
    local flags=""
    case "$3" in llama*) flags=$NO_BI ;; esac
    (cd "$1" && PYTHONPATH="$HOME/site:$1" timeout 150 python3 -m asyncstep bench latency \
        --no-hf --load-format dummy --model "$3" --batch-size 1 32 --input-len 128 \
        --output-len 64 --num-iters "${ITERS:-3}" --max-model-len 2048 $flags \
        --output-json "$OUT/latency_$3_$2_$4.json" > "$OUT/latency_$3_$2_$4.txt" 2>&1)
    echo "$3 $2 round $4: $(grep -E 'ours b' "$OUT/latency_$3_$2_$4.txt" | tr '\n' ' ')"
}

run_ab() {
    for model in $MODELS; do
        for round in $(seq 1 "$ROUNDS"); do
            latency "$BASE" base "$model" "$round"
            latency "$NEW" new "$model" "$round"
        done
    done
}

run_profile() {
    for model in $MODELS; do
        for p in ${PDLS:-0 1}; do
            local name="profile_${model}_b${PROFILE_BATCH:-1}_pdl$p"
            ASYNCSTEP_PDL=$p PYTHONPATH="$HOME/site:$NEW" timeout 90 python3 \
                benchmarks/studies/decode_kernels/quant_step_kernels.py --shape "$model" \
                --packing none --batch "${PROFILE_BATCH:-1}" --tokens 32 --top 25 $NO_BI \
                --out "$OUT/$name.json" 2>&1 | grep -vi warn > "$OUT/$name.txt"
            head -8 "$OUT/$name.txt"
        done
    done
}

run_invariant() {
    for model in $MODELS; do
        for round in $(seq 1 "$ROUNDS"); do
            NO_BI=--no-batch-invariant latency "$NEW" fast "$model" "$round"
            NO_BI=--batch-invariant latency "$NEW" invariant "$model" "$round"
        done
    done
}

case "${1:-}" in
tests) run_tests ;;
ab) run_ab ;;
profile) run_profile ;;
invariant) run_invariant ;;
*) echo "usage: $0 tests|ab|profile|invariant" >&2; exit 2 ;;
esac
