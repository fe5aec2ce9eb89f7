#!/bin/bash
# moe_vs_hf.py from two trees, alternated, N runs each (issue 41's CPU
# target, base against new on one machine): BASE_TREE NEW_TREE OUT [N].
# Each run is its own process from its tree (its library built from its
# sources); `uptime` before and after each run goes to OUT/uptime.txt.
#
#   bash benchmarks/studies/moe/alternate_moe_vs_hf.sh /tmp/base "$PWD" /tmp/ab 3
set -u
base=$1 new=$2 out=$3 n=${4:-3}
mkdir -p "$out"
for i in $(seq 1 "$n"); do
    for t in base new; do
        tree=$base
        [ "$t" = new ] && tree=$new
        echo "$t $i start $(uptime)" >>"$out/uptime.txt"
        (cd "$tree" && nice -n 19 timeout 1200 python3 benchmarks/studies/moe/moe_vs_hf.py \
            --out "$out/moe_vs_hf_${t}_$i.json" >"$out/moe_vs_hf_${t}_$i.log" 2>&1)
        echo "$t $i end   $(uptime)" >>"$out/uptime.txt"
    done
done
grep -H ratio "$out"/*.log
