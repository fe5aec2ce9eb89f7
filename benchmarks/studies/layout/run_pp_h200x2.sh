#!/usr/bin/env bash
# The pipeline boundary (issue 13) on nvidia-h200-x2, one stage per device call:
#     bash benchmarks/studies/layout/run_pp_h200x2.sh throughput TAG | transfer TAG | profile TAG
# throughput: llama-8b, 256 random requests (100-1024 in / out), 64 a step,
#   PP = 1 on GPU 0 then PP = 2 on both, traced; span tables per process.
# transfer: python3 -m asyncstep.bench.pp_transfer --tp 1 (one hop through the channel).
# profile: cProfile of the runner's calls, llama-1b at batch 1 and 256 (GPU 0).
# Output to $OUT (default benchmarks/results/pp), files named with TAG.
set -u
OUT=${OUT:-benchmarks/results/pp}
TAG=${2:-run}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BENCH="python3 -m asyncstep bench throughput --load-format dummy --model llama-8b --no-hf
    --max-num-seqs 64 --num-prompts 256"
case "$1" in
throughput)
    for pp in 1 2; do
        dev=""; [ "$pp" = 1 ] && dev="env CUDA_VISIBLE_DEVICES=0"
        rm -rf "/tmp/tr_$pp"
        timeout 200 $dev $BENCH --pp $pp --trace-dir "/tmp/tr_$pp" \
            --output-json "$OUT/throughput_llama-8b_pp${pp}_$TAG.json" 2>&1 | grep -E "tok/s|busy|│ *256" | tail -3
        timeout 60 python3 benchmarks/studies/host/span_table.py /tmp/tr_$pp/*.jsonl* --from-step 40 \
            > "$OUT/spans_llama-8b_pp${pp}_$TAG.txt" 2>&1
        cat "$OUT/spans_llama-8b_pp${pp}_$TAG.txt"
    done ;;
transfer)
    timeout 200 python3 -W ignore -m asyncstep.bench.pp_transfer --tp 1 --pp 2 \
        --out "$OUT/transfer_pp2xtp1_$TAG.json" 2>&1 | tee "$OUT/transfer_pp2xtp1_$TAG.txt" | tail -30 ;;
profile)
    for b in 1 256; do
        CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/studies/overlap/profile_decode.py --shape llama-1b \
            --batch "$b" --top 45 --dump "$OUT/profile_llama-1b_b${b}_$TAG.prof" > "$OUT/profile_llama-1b_b${b}_$TAG.txt" 2>&1
        head -60 "$OUT/profile_llama-1b_b${b}_$TAG.txt" | grep -v "^$"
    done ;;
*)
    echo "usage: $0 throughput|transfer|profile TAG" >&2; exit 2 ;;
esac
