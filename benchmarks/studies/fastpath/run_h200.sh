#!/usr/bin/env bash
# The GPU fast-path measurements (issue 5; issue 4's busy figure), one stage
# per call so each fits the device tool's 10-minute limit:
#     bash benchmarks/studies/fastpath/run_h200.sh tests|kernels|latency8b|latency8b-steady|latency1b|host1b|
#                                 qwen|throughput|overlap|tests2|allreduce|tp2|pp2|pp2-steady
#     (tests2, allreduce, tp2, pp2, pp2-steady: on nvidia-h200-x2)
# Output (text and JSON) goes to $OUT (default benchmarks/results/fastpath).
set -u
OUT=${OUT:-benchmarks/results/fastpath}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BENCH="python3 -m asyncstep bench"
case "$1" in
tests)
    ASYNCSTEP_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_triton_attention.py tests/gpu/test_triton_fused.py tests/runner/test_cudagraph.py \
        tests/runner/test_ubatching.py tests/gpu/test_gpu.py tests/runner/test_runner.py tests/engine/test_engine.py \
        > "$OUT/gpu_tests_h200.txt" 2>&1
    tail -5 "$OUT/gpu_tests_h200.txt" ;;
kernels)
    timeout 150 python3 benchmarks/studies/fastpath/attention_kernel.py --out "$OUT/attention_kernel.json" \
        2>&1 | tee "$OUT/attention_kernel.txt"
    timeout 150 python3 benchmarks/studies/fastpath/fused_kernels.py --out "$OUT/fused_kernels.json" \
        2>&1 | tee "$OUT/fused_kernels.txt" ;;
latency8b)
    timeout 280 $BENCH latency --hf --num-iters 1 --load-format dummy --model llama-8b --batch-size 1 32 --input-len 128 --output-len 64 \
        --output-json "$OUT/latency_llama-8b_p128.json" 2>&1 | tail -12
    timeout 280 $BENCH latency --hf --num-iters 1 --load-format dummy --model llama-8b --batch-size 32 --input-len 1024 --output-len 64 \
        --output-json "$OUT/latency_llama-8b_p1024.json" 2>&1 | tail -10 ;;
latency8b-steady)  # steady-decode ITL; HF quoted from the latency8b run
    timeout 200 $BENCH latency --num-iters 1 --load-format dummy --model llama-8b --batch-size 32 --input-len 1024 \
        --output-len 64 --hf-from benchmarks/results/fastpath/latency_llama-8b_p1024_whole-output-itl.json \
        --output-json "$OUT/latency_llama-8b_p1024.json" 2>&1 | tail -8 ;;
latency1b)
    timeout 280 $BENCH latency --hf --num-iters 1 --load-format dummy --model llama-1b --batch-size 1 32 --input-len 128 \
        --output-len 64 --output-json "$OUT/latency_llama-1b_p128.json" 2>&1 | tail -10 ;;
host1b)  # the host-bound shape: steps in flight (2, 3), GIL switch interval 0.5 ms or Python's
    for variant in "d2:" "d3:--max-concurrent-batches 3" \
        "d2py:--gil-switch-interval-s none" \
        "d3py:--max-concurrent-batches 3 --gil-switch-interval-s none"; do
        name=${variant%%:*}
        timeout 100 $BENCH latency --no-hf --load-format dummy --model llama-1b --batch-size 1 --input-len 128 \
            --output-len 64 --num-iters 3 ${variant#*:} \
            --output-json "$OUT/host1b/latency_llama-1b_b1_x3_$name.json" 2>&1 | grep "ours b1"
    done ;;
qwen)
    timeout 250 $BENCH latency --hf --num-iters 1 --load-format dummy --model qwen3-0.6b --batch-size 1 32 --input-len 128 \
        --output-len 64 --output-json "$OUT/latency_qwen3-0.6b_p128.json" 2>&1 | tail -10 ;;
throughput)
    timeout 550 $BENCH throughput --load-format dummy --model llama-1b --no-hf \
        --output-json "$OUT/throughput_llama-1b.json" 2>&1 | tail -12 ;;
overlap)
    for shape in llama-8b llama-1b; do
        timeout 250 python3 benchmarks/studies/overlap/overlap_decode.py --shape "$shape" --batch 1 32 \
            --output-len 96 --repeats 1 --summary --out "$OUT/overlap_$shape.json" \
            --trace-dir "$OUT/traces" 2>&1 | grep -E "^batch" | tee -a "$OUT/overlap.txt"
    done
    rm -f "$OUT"/traces/*.jsonl* ;;
tests2)
    ASYNCSTEP_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_gpu.py > "$OUT/gpu_tests_x2.txt" 2>&1
    tail -5 "$OUT/gpu_tests_x2.txt" ;;
allreduce)
    timeout 200 python3 benchmarks/studies/fastpath/allreduce.py --out "$OUT/allreduce.json" 2>&1 \
        | tee "$OUT/allreduce.txt" ;;
tp2)
    timeout 400 $BENCH latency --num-iters 1 --load-format dummy --model llama-8b --batch-size 1 32 --input-len 128 --output-len 64 \
        --tp 2 --no-hf --output-json "$OUT/latency_llama-8b_tp2.json" 2>&1 | tail -10 ;;
pp2)  # batch 64 a step; with PP = 2 each step in flight holds its own 64 requests
    B="$BENCH throughput --load-format dummy --model llama-8b --no-hf --max-num-seqs 64"
    timeout 150 $B --num-prompts 256 --pp 1 --output-json "$OUT/throughput_llama-8b_n256_pp1.json" \
        2>&1 | grep "│ *256"
    timeout 150 $B --num-prompts 256 --pp 2 --output-json "$OUT/throughput_llama-8b_n256_pp2.json" \
        2>&1 | grep "│ *256"
    for d in 3 4; do
        timeout 140 $B --num-prompts 256 --pp 2 --max-concurrent-batches $d \
            --output-json "$OUT/throughput_llama-8b_n256_pp2_d$d.json" 2>&1 | grep "│ *256"
    done ;;
pp2-steady)  # every request 256 in / 256 out: full steps, no long tail
    B="$BENCH throughput --load-format dummy --model llama-8b --no-hf --max-num-seqs 64"
    B="$B --num-prompts 512 --min-len 256 --max-len 256"
    timeout 100 $B --pp 1 --output-json "$OUT/throughput_llama-8b_n512_len256_pp1.json" 2>&1 | grep "│ *512"
    for d in 2 3; do
        timeout 100 $B --pp 2 --max-concurrent-batches $d \
            --output-json "$OUT/throughput_llama-8b_n512_len256_pp2_d$d.json" 2>&1 | grep "│ *512"
    done ;;
esac
