#!/usr/bin/env bash
# The serving measurements (issue 16) on one H200, a list of runs per device call:
#     bash benchmarks/studies/serve/run_serve_h200.sh RUN...
# RUN is MODEL:CONCURRENCY:RATE:CLIENTS[:SERVE-FLAGS] (RATE inf = all at once),
# e.g. llama-1b:64:inf:4 or llama-1b:64:inf:4:--api-server-count=4.
# 256 requests of 256 random tokens in, 128 out, dummy weights; HTTP and the
# in-process API in each run. Output to $OUT (default benchmarks/results/serve/h200).
set -u
OUT=${OUT:-benchmarks/results/serve/h200}
mkdir -p "$OUT"
for run in "$@"; do
    IFS=: read -r model conc rate clients flags <<< "$run"
    name="${model}_c${conc}_r${rate}_p${clients}${flags:+_${flags//[^a-z0-9]/}}"
    echo "== $name"
    timeout 280 python3 -m asyncstep bench serve --in-process --load-format dummy --num-prompts 256 \
        --input-len 256 --output-len 128 --goodput ttft:500 tpot:50 --model "$model" \
        --max-concurrency "$conc" --request-rate "$rate" --client-processes "$clients" \
        ${flags//=/ } --output-json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    echo "rc $?"; grep -E "│|┃|error" "$OUT/$name.txt"
done
