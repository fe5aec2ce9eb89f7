#!/usr/bin/env bash
# A tiny gpt-oss (tiny_gpt_oss.py's shape, random weights) decoding on the
# CPU op set: the tree before attention sinks were the CPU kernel's (its
# attention ran the torch reference for sink layers) against this one, in
# alternating pairs, float32 and bfloat16, batch 1 and 8, prompts of 256
# tokens (past the 128-token window), 64 tokens out.
# Usage: benchmarks/studies/sinks/run_cpu.sh BEFORE_TREE [OUT_DIR]
# (BEFORE_TREE: e.g. `git archive cc67666 | tar -x -C /tmp/before`).
set -euo pipefail
before=$(realpath "$1")
after=$(pwd)
out=$(realpath -m "${2:-benchmarks/results/sinks_1205}")
mkdir -p "$out"
model=$(mktemp -d)
python benchmarks/studies/sinks/tiny_gpt_oss.py "$model"
args=(--model "$model" --load-format dummy --batch-size 1 8 --input-len 256 --output-len 64
      --num-iters 3 --no-floor)
for pair in 1 2; do
    for dtype in float32 bfloat16; do
        for tree in before after; do
            root=$([ "$tree" = before ] && echo "$before" || echo "$after")
            (cd "$root" && PYTHONPATH="$root" nice -n 19 python -m asyncstep bench latency \
                "${args[@]}" --dtype "$dtype" --output-json "$out/${tree}_${dtype}_$pair.json")
        done
    done
done
lscpu > "$out/lscpu.txt"
