#!/usr/bin/env bash
# One device call (issue 41): the decode ITL at batch 1 with the base tree
# (build/base: `git archive 7179f8d asyncstep`) and this tree, alternated, on
# the Qwen3 shapes whose q/k norms the split-KV kernel now applies; then the
# fused-decode tests on CUDA. Carry: .whl build/base.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$HOME/site" .whl/*.whl || exit 1
R="$OUT/r"; mkdir -p "$R"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$R/machine.txt" 2>&1
lat() {  # tree tag model
    PYTHONPATH="$HOME/site:$1" timeout 200 python3 -m asyncstep bench latency --no-hf \
        --load-format dummy --model "$3" --batch-size 1 --input-len 128 --output-len 64 \
        --num-iters 3 --max-model-len 2048 --out "$R/$2.json" > "$R/$2.txt" 2>&1
    echo "$2 rc=$? $(grep -o 'ITL [0-9.]* ms' "$R/$2.txt" | head -1)"
}
for m in qwen3-0.6b qwen3-30b-a3b; do
    for i in 1 2; do
        lat "$PWD/build/base" "base_${m}_$i" "$m"
        lat "$PWD" "new_${m}_$i" "$m"
    done
done | tee "$R/summary.txt"
ASYNCSTEP_TEST_DEVICE=cuda PYTHONPATH="$HOME/site:$PWD" timeout 240 python3 -m pytest -q \
    tests/models/test_fused_decode.py -k "inside_the_decode_kernel or qwen3_layer" \
    > "$R/tests.txt" 2>&1; echo "tests rc=$?" | tee -a "$R/summary.txt"
tail -3 "$R/tests.txt"
cd "$OUT" && tar -czf r.tgz r && rm -rf r
