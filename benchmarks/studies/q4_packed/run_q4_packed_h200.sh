#!/usr/bin/env bash
# Q4 at its own floor (issue 43): the Q4 GEMV with packed math, on one H200
# (the device tool's nvidia-h200); the steps that made benchmarks/results/quant_gpu/packed
# (there run from benchmarks/ on branch gpu-43, with ASYNCSTEP_Q4_INT8 for the activations).
# Steps, any of them, in order:
#     bash benchmarks/studies/q4_packed/run_q4_packed_h200.sh profile|kernels|ncu|latency|fused|tests ...
#   profile: the llama-8b Q4 batch-1 decode step's kernels (decode_kernels/quant_step_kernels.py),
#            int8 activations
#   kernels: decode_kernels/quant_gpu.py at one row: bf16 against the Q4 GEMV launches in
#            $LAUNCHES (default: the kept launch without / with prefetch, int8), the LM head (Q8),
#            once for each ASYNCSTEP_PDL in $PDLS (default 1)
#   ncu:     Nsight Compute on the first six Q4 GEMVs of quant_gpu.py (--clock-control none)
#   latency: llama-8b ITL, batch 1, for each PACKING:ACTIVATIONS:PDL in $CASES (default: Q4
#            int8 with PDL, Q4 float without, bf16), one after another on one machine
#   fused:   decode_kernels/fused_gemv.py (a layer's four fused GEMVs) for each INT8:PDL in $FUSED
#   tests:   the quant path's GPU tests
# ACTIVATIONS: --gpu-q4-activations (float | int8); ASYNCSTEP_PDL=0: no programmatic
# dependent launch. Output goes to $OUT (default benchmarks/results/quant_gpu/packed); at
# most 8 files come back from the device.
set -u
OUT=${OUT:-benchmarks/results/quant_gpu/packed}
mkdir -p "$OUT"
STUDY=benchmarks/studies/decode_kernels
LAUNCHES=${LAUNCHES:---launch 8,64,2,0,1,1 --launch 8,64,2,1,1,1}
LATENCY="python3 -m asyncstep bench latency --no-hf --load-format dummy --model llama-8b"
LATENCY="$LATENCY --batch-size 1 --input-len 128 --output-len 64 --num-iters ${ITERS:-1}"
for step in "$@"; do
    echo "== $step $(date -u +%FT%TZ)"
    case "$step" in
    profile)
        timeout 200 python3 $STUDY/quant_step_kernels.py --shape llama-8b --packing q4 --int8 \
            --top 20 --out "/tmp/step_kernels_q4.json" 2>&1 | grep -vi warn | tee "$OUT/step_kernels_q4.txt" ;;
    kernels)
        for pdl in ${PDLS:-1}; do
            ASYNCSTEP_PDL=$pdl timeout 240 python3 $STUDY/quant_gpu.py --rows 1 --lm-head --replays 20 \
                $LAUNCHES --out "/tmp/kernels_pdl$pdl.json" 2>&1 | grep -vi warn \
                | tee "$OUT/kernels_llama-8b_pdl$pdl.txt"
        done ;;
    ncu)
        timeout 240 ncu --clock-control none -k regex:_gemv_kernel -c 6 \
            --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
            python3 $STUDY/quant_gpu.py --rows 1 --layers 1 --replays 1 ${NCU_LAUNCH:---launch 8,64,2,0,1,1} \
            > "$OUT/ncu_gemv.txt" 2>&1
        grep -E "_gemv_kernel|Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" "$OUT/ncu_gemv.txt" | head -60 ;;
    latency)
        for case in ${CASES:-q4:int8:1 q4:float:0 none:float:1}; do
            IFS=: read -r packing activations pdl <<< "$case"
            tag=${packing}_${activations}_pdl$pdl
            ASYNCSTEP_PDL=$pdl timeout 200 $LATENCY --weight-packing "$packing" \
                --gpu-q4-activations "$activations" \
                --output-json "/tmp/latency_$tag.json" > "$OUT/latency_llama-8b_$tag.txt" 2>&1
            echo "weight_packing=$packing gpu_q4_activations=$activations ASYNCSTEP_PDL=$pdl"
            grep -E "ours b|│ +[0-9]|bandwidth" "$OUT/latency_llama-8b_$tag.txt"
        done ;;
    fused)
        for case in ${FUSED:-1:1 0:0}; do
            IFS=: read -r int8 pdl <<< "$case"
            echo "int8=$int8 ASYNCSTEP_PDL=$pdl"
            flag=$([ "$int8" = 1 ] && echo --int8)
            ASYNCSTEP_PDL=$pdl timeout 120 python3 $STUDY/fused_gemv.py $flag \
                2>&1 | grep -vi warn | tee "$OUT/fused_gemv_int8x${int8}_pdl$pdl.txt"
        done ;;
    tests)
        ASYNCSTEP_TEST_DEVICE=cuda timeout 400 python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_triton_quant.py tests/models/test_fused_decode.py \
            tests/gpu/test_triton_attention.py tests/runner/test_cudagraph.py > "$OUT/gpu_tests_h200.txt" 2>&1
        tail -5 "$OUT/gpu_tests_h200.txt" ;;
    esac
done
