#!/usr/bin/env bash
# One device call (issue 41, issue 43): the CUDA tests of the split-KV
# kernel's fusions first, then the decode ITL from three trees on one card:
# build/base (`git archive 7179f8d asyncstep`: neither), build/qk
# (`git archive 2914cea asyncstep`: the q/k norms in the split-KV kernel)
# and this tree (also the segments' combine in its last program and the
# dense fused decode for 16-bit models; with `moe_fused_decode.patch.txt`
# applied, the fused decode of 16-bit MoE layers too: the branch moe-fused).
# Carry: .whl build/base build/qk. Results: $OUT/r.tgz, re-made after each step.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$HOME/site" .whl/*.whl || exit 1
R="$OUT/r"; mkdir -p "$R"
pack() { (cd "$OUT" && tar -czf r.tgz r); }
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} > "$R/machine.txt" 2>&1
ASYNCSTEP_TEST_DEVICE=cuda PYTHONPATH="$HOME/site:$PWD" timeout 150 python3 -m pytest -q \
    tests/models/test_fused_decode.py \
    -k "inside_the_decode_kernel or qwen3_layer or last_segment or 16_bit_model or same_greedy" \
    > "$R/tests.txt" 2>&1
ASYNCSTEP_TEST_DEVICE=cuda PYTHONPATH="$HOME/site:$PWD" timeout 150 python3 -m pytest -q -x \
    tests/gpu/test_triton_attention.py tests/gpu/test_triton_sinks.py tests/gpu/test_greedy_graph_cuda.py \
    tests/gpu/test_triton_gemv.py tests/gpu/test_moe_routing.py \
    >> "$R/tests.txt" 2>&1
echo "tests rc=$? $(grep -E 'passed|failed' "$R/tests.txt" | tr '\n' ' ')" | tee "$R/summary.txt"; pack
lat() {  # tree tag model batch... (the fast op set: dense models default to the invariant one)
    local tree=$1 tag=$2 model=$3; shift 3
    PYTHONPATH="$HOME/site:$tree" timeout 170 python3 -m asyncstep bench latency --no-hf \
        --no-batch-invariant \
        --load-format dummy --model "$model" --batch-size "$@" --input-len 128 --output-len 64 \
        --num-iters 3 --max-model-len 2048 --out "$R/$tag.json" > "$R/$tag.txt" 2>&1
    echo "$tag rc=$? $(grep -o 'ITL [0-9.]* ms' "$R/$tag.txt" | tr '\n' ' ')" | tee -a "$R/summary.txt"
    pack
}
B="$PWD/build/base" Q="$PWD/build/qk" N="$PWD"
lat "$B" base_qwen3-30b-a3b qwen3-30b-a3b 1
lat "$N" new_qwen3-30b-a3b qwen3-30b-a3b 1
lat "$Q" qk_qwen3-30b-a3b qwen3-30b-a3b 1
lat "$B" base_llama-1b llama-1b 1 32
lat "$N" new_llama-1b llama-1b 1 32
lat "$B" base_gpt-oss-20b gpt-oss-20b 1
lat "$N" new_gpt-oss-20b gpt-oss-20b 1
lat "$N" new2_qwen3-30b-a3b qwen3-30b-a3b 1
lat "$B" base2_qwen3-30b-a3b qwen3-30b-a3b 1
rm -rf "$R.keep"; echo done | tee -a "$R/summary.txt"; pack; rm -rf "$R"
