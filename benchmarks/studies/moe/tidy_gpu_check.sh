#!/usr/bin/env bash
# The tidy branch on one GPU (the device tool's nvidia-h100-x1 or nvidia-h200): the GPU
# tests over what it moved (asyncstep.config and asyncstep.datatypes split into packages,
# the MoE block's renormalisation read from the config, gpt-oss's GGUF expert stacks),
# then one small gpt-oss-20b latency run (dummy weights) against the same run of main
# where the lead has it: the numbers must not move beyond noise.
#     bash benchmarks/studies/moe/tidy_gpu_check.sh
# Dependencies: as run_moe_h200.sh (`bash ../shared/device/wheels.sh` once, carry ".whl").
# Output (text and JSON) goes to $OUT (default benchmarks/results/moe); under 5 minutes.
set -u
OUT=${OUT:-benchmarks/results/moe}
mkdir -p "$OUT"
export PYTHONPATH="$HOME/site:$PWD"
if ! python3 -c "import trio, structlog, msgspec, gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$HOME/site" .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/tidy_machine.txt" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_moe.py \
    tests/gpu/test_triton_sinks.py tests/test_config.py 2>&1 | tail -15 | tee "$OUT/tidy_tests.txt"
timeout 120 python3 -m asyncstep bench latency --no-hf --model gpt-oss-20b --load-format dummy \
    --device cuda --dtype bfloat16 --batch-size 1 --input-len 128 --output-len 32 --num-iters 3 \
    --max-model-len 2048 \
    --output-json "$OUT/tidy_latency_gpt_oss.json" 2>&1 | tail -15 | tee "$OUT/tidy_latency.txt"
