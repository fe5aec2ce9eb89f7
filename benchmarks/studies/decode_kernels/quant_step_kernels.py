"""Where a decode step's device time goes, by kernel: ``--batch`` requests
(default 1) decoding together on dummy weights, ``weight_packing`` as given,
the engine in this process;
torch's profiler (CUPTI: the kernels of CUDA graph replays too) over the
decode of ``--tokens`` greedy tokens after a warm-up request (greedy as
``asyncstep bench latency`` samples; ``--random`` for temperature 1); the
prompts' prefill (``--prompt-len`` tokens each, default 128) is in the
window too: a few tokens leave the decode. Prints each kernel
name's device time per step, grouped (the Q4 / Q8 GEMV, torch's GEMV, the
rest), and the sum, which is below the ITL by the device's idle time.

    python3 benchmarks/studies/decode_kernels/quant_step_kernels.py --shape llama-8b --packing q4 \
        [--batch N] [--prompt-len N] [--no-fused-decode] [--[no-]batch-invariant] [--int8]
        [--out FILE]

``--int8``: ``gpu_q4_activations="int8"`` (the Q4 / Q8 GEMVs quantize x to int8).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

import asyncstep
from asyncstep import SamplingParams


async def run(args: argparse.Namespace) -> dict[str, float]:
    async with asyncstep.open_engine(
        args.shape,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=args.batch,
        weight_packing=args.packing,
        fused_decode=args.fused_decode,
        batch_invariant=args.batch_invariant,
        gpu_q4_activations="int8" if args.int8 else "float",
        engine_process=False,
    ) as engine:
        prompt = list(range(3, 3 + args.prompt_len))
        temperature = 1.0 if args.random else 0.0
        warm_up = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True)
        await engine.generate(prompt, warm_up)
        params = SamplingParams(
            temperature=temperature, max_tokens=args.tokens + 1, ignore_eos=True
        )
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            async with trio.open_nursery() as nursery:
                for _ in range(args.batch):
                    nursery.start_soon(engine.generate, prompt, params)
            torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / args.tokens  # us a step
    return dict(per_kernel)


def group(name: str) -> str:
    if "_dense_gemv_kernel" in name:
        return "dense GEMV (Triton)"
    if "_gemv_kernel" in name:
        return "Q4/Q8 GEMV"
    if "gemv" in name.lower() or "gemm" in name.lower() or "nvjet" in name.lower():
        return "torch GEMV/GEMM"
    if "attention" in name.lower() or "attn" in name.lower():
        return "attention"
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--packing", default="q4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--prompt-len", type=int, default=128, help="prompt tokens (few: the decode dominates)"
    )
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument(
        "--no-fused-decode", dest="fused_decode", action="store_false", help="fused_decode=False"
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch_invariant (default: the engine's choice for CUDA)",
    )
    parser.add_argument("--random", action="store_true", help="sample at temperature 1")
    parser.add_argument("--int8", action="store_true", help='gpu_q4_activations="int8"')
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    per_kernel = trio.run(run, args)
    groups: dict[str, float] = defaultdict(float)
    for name, us in per_kernel.items():
        groups[group(name)] += us
    print(
        f"{args.shape} batch {args.batch}, weight_packing={args.packing},"
        f" fused_decode={args.fused_decode}, batch_invariant={args.batch_invariant},"
        f" int8={args.int8}: device us a step by group"
    )
    for name, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {us:8.1f}")
    print(f"  {'sum':20s} {sum(per_kernel.values()):8.1f}")
    print("top kernels (us a step):")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {us:8.1f}  {name[:110]}")
    if args.out:
        shown = {k: str(v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"args": shown, "us": per_kernel}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
