#!/usr/bin/env bash
# What the cpu40 branch could not resolve on a loaded machine, again on a
# quiet CPU (no GPU is used): the decode attention of 30 layers (64 and 16
# requests, 1 and 2 threads) with a request's next KV block prefetched
# (benchmarks/results/cpu/step64_1205/attention_prefetch_not_kept.patch,
# applied to a copy of this tree) against this tree, then a bfloat16 KV
# cache against the float32 one. Each step under `timeout`, about 3 minutes
# on 2 quiet cores; files in $OUT (default /tmp/cpu40_quiet).
#
#   bash benchmarks/studies/cpu_kernels/cpu40_quiet.sh
set -u
OUT=${OUT:-/tmp/cpu40_quiet}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
here=benchmarks/studies/cpu_kernels
{ lscpu | grep -i -E 'model name|flags'; uptime; } > "$OUT/machine.txt"
prefetch=$OUT/prefetch_tree
rm -rf "$prefetch" && mkdir -p "$prefetch" && cp -r asyncstep "$prefetch/"
patch -s -d "$prefetch" -p1 < benchmarks/results/cpu/step64_1205/attention_prefetch_not_kept.patch
for layout in engine random; do
    timeout 90 python3 $here/attention_builds.py . "$prefetch" --rows 16 64 --threads 1 2 \
        --layout $layout --repeats 11 --build-dir "$OUT" > "$OUT/prefetch_$layout.txt" 2>&1
    uptime >> "$OUT/prefetch_$layout.txt"
done
timeout 60 python3 $here/attention_builds.py . . --rows 16 64 --threads 1 2 \
    --dtype float32 --b-dtype bfloat16 --repeats 9 --build-dir "$OUT" > "$OUT/attention_bf16.txt" 2>&1
uptime >> "$OUT/attention_bf16.txt"
tail -n 4 "$OUT"/*.txt
