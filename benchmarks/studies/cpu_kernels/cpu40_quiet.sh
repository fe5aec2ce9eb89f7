#!/usr/bin/env bash
# The cpu40 branch's A/B figures again on a quiet CPU (no GPU is used; the
# branch changes the CPU library only): A = the tree before it (BEFORE, a
# source tree: `git archive <rev> asyncstep | tar -x -C DIR`), B = this one.
# Each step under `timeout`, about 4 minutes in all on 2 quiet cores; files
# in $OUT (default /tmp/cpu40_quiet). Results: benchmarks/results/cpu/step64_1205/.
#
#   BEFORE=/tmp/before bash benchmarks/studies/cpu_kernels/cpu40_quiet.sh
set -u
OUT=${OUT:-/tmp/cpu40_quiet}
BEFORE=${BEFORE:?a source tree of the baseline}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
here=benchmarks/studies/cpu_kernels
{ lscpu | grep -i -E 'model name|flags'; uptime; } > "$OUT/machine.txt"
# the stack with silu * up fused into gate_up, on the engine's own steps (1 and 2 threads)
for threads in 1 2; do
    timeout 100 python3 $here/stack_builds.py "$BEFORE" . --num-prompts 16 64 \
        --output-len 24 --threads $threads --build-dir "$OUT" > "$OUT/stack_t$threads.txt" 2>&1
    uptime >> "$OUT/stack_t$threads.txt"
done
# a bfloat16 KV cache against the float32 one: the decode attention of 30 layers
timeout 60 python3 $here/attention_builds.py "$BEFORE" "$BEFORE" --rows 16 64 --threads 1 2 \
    --dtype float32 --b-dtype bfloat16 --repeats 9 --build-dir "$OUT" > "$OUT/attention_bf16.txt" 2>&1
uptime >> "$OUT/attention_bf16.txt"
ls -l "$OUT"
