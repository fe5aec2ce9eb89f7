#!/bin/bash
# The MoE tiny model at the engine's default dtype (bfloat16 on this
# AVX512-BF16 / AMX CPU) before and after the bfloat16 experts, and against
# HF generate in float32 and in bfloat16; each run its own process, in turn,
# two rounds: BASE_TREE NEW_TREE OUT.
#
#   bash benchmarks/results/cpu/moe_bf16_1206/run.sh /tmp/base_tree "$PWD" OUT
set -u
base=$1 new=$2 out=$3
mkdir -p "$out"
one() {  # tree tag dtype hf_dtype
    echo "$2 start $(uptime)" >>"$out/uptime.txt"
    (cd "$1" && nice -n 19 timeout 1200 python3 benchmarks/studies/moe/moe_vs_hf.py \
        --dtype "$3" --hf-dtype "$4" --out "$out/$2.json" >"$out/$2.log" 2>&1)
    echo "$2 end   $(uptime)" >>"$out/uptime.txt"
}
for i in 1 2; do
    one "$new" "new_auto_hf32_$i" auto float32
    one "$new" "new_f32_hf32_$i" float32 float32
    one "$new" "new_auto_hf16_$i" auto bfloat16
done
# (the base tree runs this tree's moe_vs_hf.py: its --dtype flags)
one "$base" base_auto_hf32_1 auto float32
grep -H ratio "$out"/*.log
