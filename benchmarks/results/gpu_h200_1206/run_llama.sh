#!/usr/bin/env bash
# A short device call: llama-1b at batch 1 and 32 (the fast op set) from the
# session's base tree (build/base: `git archive 7179f8d asyncstep`) and this
# tree (the q/k norms and the segments' combine in the split-KV kernel; the
# dense fused decode reverted), alternated twice. Carry: .whl build/base.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$HOME/site" .whl/*.whl || exit 1
R="$OUT/r"; mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader > "$R/machine.txt" 2>&1
lat() {  # tree tag
    PYTHONPATH="$HOME/site:$1" timeout 100 python3 -m asyncstep bench latency --no-hf \
        --no-batch-invariant --load-format dummy --model llama-1b --batch-size 1 32 \
        --input-len 128 --output-len 64 --num-iters 3 --max-model-len 2048 \
        --out "$R/$2.json" > "$R/$2.txt" 2>&1
    echo "$2 rc=$? $(grep -o 'ITL [0-9.]* ms' "$R/$2.txt" | tr '\n' ' ')" | tee -a "$R/summary.txt"
}
for i in $(seq 1 "${ROUNDS:-2}"); do lat "$PWD/build/base" "base_$i"; lat "$PWD" "new_$i"; done
cd "$OUT" && tar -czf r.tgz r && rm -rf r
