#!/usr/bin/env bash
# The MoE decode step at batch 1 (issue 41, task moestep) on one GPU (nvidia-h100-x1):
#     bash benchmarks/studies/moe/run_moestep_h100.sh tests|kernels|step|profile|latency
#   tests:   tests/gpu/test_moe_routing.py, test_triton_gemv.py and test_triton_fused.py
#            compiled for the GPU (ASYNCSTEP_TEST_DEVICE=cuda: the
#            routing's load counter, the GEMV's bias, the q/k norms' kernel)
#   kernels: fused_moe_kernel.py at T = 1 and 2, qwen3-30b-a3b and gpt-oss-20b shapes: one
#            layer of the experts in a CUDA graph against the floor; the routing (--routing
#            at T = 1, 8). (Its --gemv-tile runs of the stacked and pairs down kernels:
#            benchmarks/results/moestep/README.md.)
#   step:    profile then latency (both under 5 min with the timeouts below)
#   profile: quant_step_kernels.py for both models at batch 1 (us a step by kernel)
#   latency: asyncstep bench latency --no-hf, both models, batch 1 and 32, dummy weights
# Dependencies: run `bash ../shared/device/wheels.sh` once here and carry ".whl".
# Output (text and JSON) goes to $OUT (default benchmarks/results/moestep).
set -u
OUT=${OUT:-benchmarks/results/moestep}
mkdir -p "$OUT"
export PYTHONPATH="$HOME/site:$PWD"
if ! python3 -c "import trio, structlog, msgspec, gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$HOME/site" .whl/*.whl || exit 1
fi
MODELS=${MODELS:-qwen3-30b-a3b gpt-oss-20b}
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
    ASYNCSTEP_TEST_DEVICE=cuda timeout 280 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_moe_routing.py tests/gpu/test_triton_gemv.py tests/gpu/test_triton_fused.py \
        > "$OUT/gpu_tests.txt" 2>&1
    tail -6 "$OUT/gpu_tests.txt"
}
run_kernels() {
    timeout 270 python3 benchmarks/studies/moe/fused_moe_kernel.py --tokens 1 2 \
        --routing --routing-tokens 1 8 --out "$OUT/kernels.json" 2>&1 | grep -vi warn \
        > "$OUT/kernels.txt"
    cat "$OUT/kernels.txt"
}
run_profile() {
    for model in $MODELS; do
        echo "=== $model b1"
        timeout 70 python3 benchmarks/studies/decode_kernels/quant_step_kernels.py --shape "$model" \
            --packing none --batch 1 --tokens 16 --top 40 --out "$OUT/profile_$model.json" 2>&1 \
            | grep -vi warn | tee "$OUT/profile_$model.txt"
    done
}
run_latency() {
    for model in $MODELS; do
        timeout 75 python3 -m asyncstep bench latency --no-hf --load-format dummy --model "$model" \
            --batch-size 1 32 --input-len 128 --output-len 64 --num-iters 2 --max-model-len 2048 \
            --output-json "$OUT/latency_$model.json" > "$OUT/latency_$model.txt" 2>&1
        echo "$model"; grep -E "ours b|failed|Error|│ +[0-9]" "$OUT/latency_$model.txt"
    done
}
machine
case "${1:-}" in
tests) run_tests ;;
kernels) run_kernels ;;
profile) run_profile ;;
latency) run_latency ;;
step) run_profile; run_latency ;;
*) echo "usage: $0 tests|kernels|step|profile|latency" >&2; exit 2 ;;
esac
