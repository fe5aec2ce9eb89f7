#!/usr/bin/env bash
# Issue 6: PP = 2 x TP = 2 with NCCL, one stage per call (each fits the device
# tool's 10-minute limit):
#     bash benchmarks/studies/layout/run_layout.sh tokens|transfer|latency|throughput|whole
# On nvidia-h200-x4 as written. On nvidia-h200-x2, RANK_GPUS=2 lays the four
# ranks on two GPUs (the two stages share them; see asyncstep/bench/rank_gpus.py):
# the protocol, the code path and the tokens are those of the layout, the
# latency and throughput are not its figures. File names then end in _on2gpus.
# Output (text and JSON) goes to $OUT (default benchmarks/results/layout).
set -u
OUT=${OUT:-benchmarks/results/layout}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TAG=${RANK_GPUS:+_on${RANK_GPUS}gpus}
RG=${RANK_GPUS:+--rank-gpus $RANK_GPUS}
BENCH="python3 -m asyncstep bench"
case "$1" in
tokens)  # greedy tokens against one GPU, fp32 (no bf16 rounding between layouts), overlap on/off
    timeout 560 python3 -m asyncstep.bench.layout_tokens --model llama-8b --dtype float32 \
        --tp 2 --pp 2 $RG --engine-opt max_num_seqs=8 \
        --out "$OUT/tokens_llama-8b_fp32_pp2xtp2$TAG.json" 2>&1 | grep -v -i warn \
        | tee "$OUT/tokens_llama-8b_fp32_pp2xtp2$TAG.txt" | tail -4 ;;
transfer)  # lanes (1/TP per lane + all-gather) against whole tensors
    timeout 300 python3 -W ignore -m asyncstep.bench.pp_transfer --tp 2 --pp 2 $RG \
        --out "$OUT/transfer_pp2xtp2$TAG.json" 2>&1 | tee "$OUT/transfer_pp2xtp2$TAG.txt" ;;
latency)  # decode ITL at batch 1 and 32, HF on one GPU in the same run
    timeout 560 $BENCH latency --hf --num-iters 1 --load-format dummy --model llama-8b --batch-size 1 32 --input-len 128 \
        --output-len 64 --tp 2 --pp 2 $RG --output-json "$OUT/latency_llama-8b_pp2xtp2$TAG.json" \
        2>&1 | tail -8 ;;
throughput)  # as issue 5's PP runs: 256 random requests, 64 a step
    timeout 400 $BENCH throughput --load-format dummy --model llama-8b --no-hf \
        --max-num-seqs 64 --num-prompts 256 --tp 2 --pp 2 $RG \
        --output-json "$OUT/throughput_llama-8b_n256_pp2xtp2$TAG.json" 2>&1 | tail -6 ;;
whole)  # latency and throughput again, whole tensors between stages (no lanes)
    W="--load-format dummy --model llama-8b --tp 2 --pp 2 $RG --no-pp-tensor-lanes"
    timeout 280 $BENCH latency --num-iters 1 $W --batch-size 1 32 --input-len 128 --output-len 64 --no-hf \
        --output-json "$OUT/latency_llama-8b_pp2xtp2_whole$TAG.json" 2>&1 | grep -E "ours b"
    timeout 280 $BENCH throughput $W --no-hf --max-num-seqs 64 --num-prompts 256 \
        --output-json "$OUT/throughput_llama-8b_n256_pp2xtp2_whole$TAG.json" 2>&1 | grep "│ *256" ;;
*)
    echo "usage: [RANK_GPUS=N] $0 tokens|transfer|latency|throughput|whole" >&2
    exit 2 ;;
esac
