#!/usr/bin/env bash
# Two data-parallel replicas (one rank each) of the embedded model behind one
# asyncstep serve, a shared-prefix load (8 system prompts x 64 users), the
# prefix router against round robin in one run (one after the other, same
# load and seed). KV cache of 80 blocks a replica: about four system prompts
# and the requests in flight. Usage: benchmarks/studies/dp/run_cpu.sh [OUT_DIR]
# (ROUTINGS="round-robin prefix" for the other order).
set -euo pipefail
out=${1:-benchmarks/results/dp}
mkdir -p "$out"
load=(--num-prompts 512 --num-prefixes 8 --prefix-len 256 --input-len 16 --output-len 8
      --max-concurrency 8 --num-warmups 0 --seed 0)
engine=(--data-parallel-size 2 --num-blocks 80 --max-model-len 512)
for routing in ${ROUTINGS:-prefix round-robin}; do
    nice -n 19 python -m asyncstep bench serve "${load[@]}" "${engine[@]}" \
        --data-parallel-routing "$routing" --output-json "$out/cpu_smollm2_dp2_$routing.json"
done
