"""Where a CPU step's time goes, per op, inside the library's decoder stack
(``cpu_decode.c``): the library built with ``-DASYNCSTEP_STACK_PROFILE``
(its own cached build: the default build has no timers), each phase's wall
time summed over the stack's calls (the master thread's clock after each
worksharing loop's barrier), and the LM head's calls timed around them.
One in-process engine on the embedded model (or ``--model``) runs ``--num-prompts`` random
prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens each (as
``bench throughput`` does), then each stack call is binned by its rows:
the prompt steps (more than ``--num-prompts`` rows) and the steps of
exactly ``--num-prompts`` rows (every request decoding). Per op: milliseconds
a step, the multiply-adds of the matmuls, and the floor of the int8
products (multiply-adds x 2 activation levels / (``--peak``, the int8
multiply-adds a second of one core, x 2 cores): ``peak/vnni_peak.c``
measures it).

    python3 benchmarks/studies/cpu_kernels/stack_profile.py --num-prompts 64 \\
        --out benchmarks/results/cpu/q4m_1205/profile64.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import trio

PHASES = (
    "norm + quantize (in)",
    "qkv matmul",
    "rotary + KV store + attention",
    "quantize (attention out)",
    "o matmul",
    "add + norm + quantize",
    "gate_up matmul",
    "silu * up + quantize",
    "down matmul",
    "stack in / out copies",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--peak", type=float, default=226.0, help="G int8 multiply-adds a second, one core"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory; default: embedded"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from asyncstep.ops.cpu import library

    library.BASE_FLAGS = (*library.BASE_FLAGS, "-DASYNCSTEP_STACK_PROFILE")
    kernels = library.load_cpu_kernels()
    assert kernels is not None, "the CPU library does not build here"
    read = kernels.library.asyncstep_stack_profile
    read.argtypes = [ctypes.POINTER(ctypes.c_double)]
    read.restype = None
    phases = (ctypes.c_double * len(PHASES))()

    from asyncstep.ops.cpu import decode_stack, ops

    calls: list[dict[str, Any]] = []
    stack_call = decode_stack.CpuDecodeStack.__call__
    head_call = ops.CpuHeadOps.logits

    def timed_stack(self: Any, hidden: torch.Tensor, *rest: Any) -> Any:
        read(phases)
        start = time.perf_counter()
        out = stack_call(self, hidden, *rest)
        wall = time.perf_counter() - start
        read(phases)
        calls.append({"op": "stack", "rows": hidden.shape[0], "wall": wall, "phases": list(phases)})
        return out

    def timed_head(self: Any, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = head_call(self, x, *rest)
        calls.append({"op": "head", "rows": x.shape[0], "wall": time.perf_counter() - start})
        return out

    decode_stack.CpuDecodeStack.__call__ = timed_stack  # type: ignore[method-assign]
    ops.CpuHeadOps.logits = timed_head  # type: ignore[method-assign]

    import asyncstep
    from asyncstep import SamplingParams
    from asyncstep.bench.workload import random_prompts

    config: dict[str, Any] = {}

    async def run() -> float:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        options = {
            "model": args.model,
            "engine_process": False,
            "cpu_threads": args.threads,
            "max_num_seqs": args.num_prompts,
            "max_num_batched_tokens": 2048,
        }
        config.update(options)
        async with asyncstep.open_engine(**options) as engine:
            prompts = random_prompts(49152, [args.input_len] * args.num_prompts, 0)
            await engine.generate(prompts[0][:8], SamplingParams(max_tokens=2))  # warm up
            calls.clear()
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for p in prompts:
                    nursery.start_soon(engine.generate, p, params)
            return time.perf_counter() - start

    seconds = trio.run(run)
    n = args.num_prompts
    steps: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in calls:
        if c["op"] == "stack":
            kind = "prompt" if c["rows"] > n else ("decode" if c["rows"] == n else "other")
            steps[kind].append(c)
    heads: dict[int, list[float]] = defaultdict(list)
    for c in calls:
        if c["op"] == "head":
            heads[c["rows"]].append(c["wall"])

    hidden, inter, qkv, layers, vocab = 576, 1536, 960, 30, 49152
    macs = {
        "qkv matmul": hidden * qkv * layers,
        "o matmul": hidden * hidden * layers,
        "gate_up matmul": hidden * 2 * inter * layers,
        "down matmul": inter * hidden * layers,
    }
    peak = 2 * args.peak * 1e9  # int8 multiply-adds a second, both cores
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "engine": config,
        "seconds": seconds,
        "out_tok_s": n * args.output_len / seconds,
        "bins": {},
    }
    for kind, cs in steps.items():
        rows = sum(c["rows"] for c in cs) / len(cs)
        per_step = [sum(c["phases"][i] for c in cs) / len(cs) for i in range(len(PHASES))]
        wall = sum(c["wall"] for c in cs) / len(cs)
        table = []
        for name, ms in zip(PHASES, per_step, strict=True):
            row: dict[str, Any] = {"op": name, "ms": round(ms * 1e3, 2)}
            if name in macs:
                row["gmacs"] = round(macs[name] * rows / 1e9, 3)
                floor = 2 * macs[name] * rows / peak
                row["floor_2lv_ms"] = round(floor * 1e3, 2)
                row["of_floor"] = round(ms / floor, 2)
            table.append(row)
        report["bins"][kind] = {
            "steps": len(cs),
            "mean_rows": rows,
            "stack_wall_ms": round(wall * 1e3, 2),
            "ops": table,
        }
    report["head"] = {
        str(r): {"calls": len(w), "mean_ms": round(1e3 * sum(w) / len(w), 2)}
        for r, w in sorted(heads.items())
    }
    head_macs = hidden * vocab
    for r, entry in report["head"].items():
        entry["floor_2lv_ms"] = round(1e3 * 2 * head_macs * int(r) / peak, 2)
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("ASYNCSTEP_LOG_LEVEL", "warning")
    sys.exit(main())
