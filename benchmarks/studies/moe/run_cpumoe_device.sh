#!/usr/bin/env bash
# The CPU MoE step (issue 41's CPU target: 16 at once >= 3x HF generate) on the device
# machine's host CPU, a quieter CPU than the shared one, pinned to 2 cores (the shared
# machine's count) with taskset; no GPU is used. Under 5 minutes with the timeouts below:
#     OUT=... bash benchmarks/studies/moe/run_cpumoe_device.sh
#   kernel: moe_kernel_ab.py, cpu_moe.c of git ref $OLD (default b689060, the base of
#           branch cpumoe) against this tree's, one thread then two, interleaved medians
#           (skipped where the tree has no git history)
#   bandwidth: read_bandwidth.py (the DRAM read rate a decode step's weights stream at)
#   shares: moe_step_shares.py, where a step's time goes (decode and prefill apart)
#   vs_hf:  moe_vs_hf.py twice (asyncstep against HF generate, the ratio)
# Dependencies: run `bash ../shared/device/wheels.sh` once here and carry ".whl"
# (transformers for the HF side). Output (JSON, text, uptime, lscpu) goes to $OUT.
set -u
OUT=${OUT:-benchmarks/results/moe_cpu/device}
OLD=${OLD:-b689060}
mkdir -p "$OUT"
export PYTHONPATH="$HOME/site:$PWD"
if ! python3 -c "import trio, structlog, msgspec, transformers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$HOME/site" .whl/*.whl || exit 1
fi
PIN="taskset -c 0,1"
CKPT=$(mktemp -d)/qwen3-moe-tiny
lscpu > "$OUT/lscpu.txt"
step() {  # name, timeout, command...
    local name=$1 limit=$2
    shift 2
    uptime > "$OUT/$name.uptime"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name: rc $? $(tail -n 1 "$OUT/$name.txt")"
    uptime >> "$OUT/$name.uptime"
}
if git rev-parse --verify -q "$OLD^{commit}" > /dev/null; then
    for threads in 1 2; do
        step "kernel_t$threads" 60 $PIN python3 benchmarks/studies/moe/moe_kernel_ab.py \
            --old "$OLD" --repeats 40 --threads "$threads" --out "$OUT/kernel_t$threads.json"
    done
fi
step bandwidth 60 $PIN python3 benchmarks/studies/moe/read_bandwidth.py
step shares 90 $PIN python3 benchmarks/studies/moe/moe_step_shares.py --checkpoint "$CKPT" \
    --out "$OUT/shares.json"
for run in 1 2; do
    step "vs_hf_$run" 75 $PIN python3 benchmarks/studies/moe/moe_vs_hf.py \
        --out "$OUT/moe_vs_hf_$run.json"
done
