"""Where a prompt step's time goes, ``batch_invariant`` off and on (issue 40):
``--batch`` prompts of ``--prompt`` tokens submitted together, one output
token each, on dummy bf16 weights, the engine in this process. Prints the
call's wall time (the TTFT: the median of 5 after a warm-up) and, from one
more call under torch's profiler (CUPTI), the device's kernel time and the
number of kernel launches, by group. Wall well above the kernel time is
the host launching kernels; kernel time near the wall is the kernels.

    python3 benchmarks/studies/invariance/gpu_prefill.py --shape llama-8b --batch 1 32
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

import asyncstep
from asyncstep import SamplingParams


def group(name: str) -> str:
    lowered = name.lower()
    if "invariant_matmul" in lowered:
        return "invariant matmul"
    if "gemm" in lowered or "gemv" in lowered or "nvjet" in lowered or "cutlass" in lowered:
        return "torch GEMM / GEMV"
    if "attention" in lowered or "attn" in lowered or "flash" in lowered:
        return "attention"
    if "norm" in lowered:
        return "norms"
    return "other"


async def prompts(engine: asyncstep.Engine, batch: int, prompt_len: int, seed: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    async with trio.open_nursery() as nursery:
        for i in range(batch):
            # Distinct prompts a call: the prefix cache serves none of them.
            start = 3 + (seed * batch + i) * 7 % 20000
            nursery.start_soon(engine.generate, list(range(start, start + prompt_len)), params)


async def measure(args: argparse.Namespace, invariant: bool, batch: int) -> dict[str, object]:
    async with asyncstep.open_engine(
        args.shape,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_model_len=args.max_model_len or args.prompt + 16,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * args.prompt),
        batch_invariant=invariant,
        engine_process=False,
    ) as engine:
        seed = 0
        for _ in range(2):  # warm-up: compiles and first launches
            seed += 1
            await prompts(engine, batch, args.prompt, seed)
        walls = []
        for _ in range(5):
            seed += 1
            torch.cuda.synchronize()
            began = time.perf_counter()
            await prompts(engine, batch, args.prompt, seed)
            walls.append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            seed += 1
            await prompts(engine, batch, args.prompt, seed)
            torch.cuda.synchronize()
    us: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us[group(event.name)] += event.device_time
            launches[group(event.name)] += 1
    return {"wall_ms": statistics.median(walls), "us": dict(us), "launches": dict(launches)}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-model-len", type=int, help="default: the prompt + 16")
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    print(f"{args.shape}, prompts of {args.prompt} tokens, one output token, {device}")
    for batch in args.batch:
        for invariant in (False, True):
            result = trio.run(measure, args, invariant, batch)
            gc.collect()  # the engine's weights and KV cache, before the next engine's
            torch.cuda.empty_cache()
            us, launches = result["us"], result["launches"]
            assert isinstance(us, dict) and isinstance(launches, dict)
            print(
                f"batch {batch:3} batch_invariant={invariant!s:5}:"
                f" wall {result['wall_ms']:7.2f} ms,"
                f" kernels {sum(us.values()) / 1e3:7.2f} ms in {sum(launches.values())} launches",
                flush=True,
            )
            for name in sorted(us, key=lambda g: -us[g]):
                print(f"    {name:20s} {us[name] / 1e3:7.2f} ms {launches[name]:6d} launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
