"""Where the MoE tiny model's CPU step goes, in-process: ``moe_cpu_time``'s
serving run (16 random prompts of 128 tokens, 64 greedy tokens each, all at
once, one rank, float32 or ``--dtype``) with the library's calls (the
bfloat16 matmul's too) and the router timed
(``perf_counter`` around each, exclusive of the timed calls inside it) and
summed over the decode steps and over the prefill steps apart (the
checkpoint written by ``moe_vs_hf.py``'s ``write_checkpoint`` where
``--checkpoint`` does not exist yet). Shares of
the steps' time (``execute_model`` + ``sample_tokens``); "other torch" is
the rest of the forward (embedding, rotary, residual adds, the router's
matmul where not the library's), "engine" the wall time outside the steps.

    PYTHONPATH=TREE python3 benchmarks/studies/moe/moe_step_shares.py \\
        --checkpoint /tmp/qwen3-moe-tiny --out RESULT.json [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).parent))
from moe_cpu_time import serve

#: Seconds per category of the current step; the stack of open timers.
_now: dict[str, float] = defaultdict(float)
_stack: list[list[float]] = []


def _timed(category: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its time (less the timed calls inside) added to
    ``category(*args)``'s."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stack.append([time.perf_counter(), 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            start, inner = _stack.pop()
            spent = time.perf_counter() - start
            _now[category(*args)] += spent - inner
            if _stack:
                _stack[-1][1] += spent

    return wrapper


def _matmul_category(_self: Any, x: Any, weight: Any, *_rest: Any) -> str:
    rows, kind = weight.shape[0], "bf16" if str(weight.dtype) == "torch.bfloat16" else "f32"
    name = "lm head" if rows >= 8192 else "router gate" if rows <= 256 else "proj"
    return f"{name} ({kind})"


def instrument() -> dict[str, dict[str, float]]:
    """Patch the timed calls; the totals, by step kind, filled as steps run."""
    from asyncstep.models.layers import moe as moe_layers
    from asyncstep.ops.cpu.attention import CpuPagedAttention
    from asyncstep.ops.cpu.dense import CpuDenseMatmul
    from asyncstep.ops.cpu.dense_f32 import CpuDenseF32Matmul
    from asyncstep.ops.cpu.layer_ops import CpuLayerOps
    from asyncstep.ops.cpu.moe import CpuMoeExperts
    from asyncstep.runner.model_runner import ModelRunner

    def named(name: str) -> Callable[..., str]:
        return lambda *_a: name

    CpuMoeExperts.__call__ = _timed(named("experts"), CpuMoeExperts.__call__)  # type: ignore[method-assign]
    CpuDenseF32Matmul.__call__ = _timed(_matmul_category, CpuDenseF32Matmul.__call__)  # type: ignore[method-assign]
    CpuDenseMatmul.__call__ = _timed(_matmul_category, CpuDenseMatmul.__call__)  # type: ignore[method-assign]
    CpuPagedAttention.__call__ = _timed(named("attention"), CpuPagedAttention.__call__)  # type: ignore[method-assign]
    for op in ("add_rms_norm", "rms_norm", "silu_and_mul"):
        setattr(CpuLayerOps, op, _timed(named("norms"), getattr(CpuLayerOps, op)))
    moe_layers.select_experts = _timed(named("routing (torch)"), moe_layers.select_experts)
    totals: dict[str, dict[str, float]] = {
        "decode": defaultdict(float),
        "prefill": defaultdict(float),
    }
    kind = ["decode"]

    def step(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if name == "execute_model":
                out = args[0]
                decode = out.total_num_scheduled_tokens <= len(out.num_scheduled_tokens)
                kind[0] = "decode" if decode else "prefill"
            _now.clear()
            start = time.perf_counter()
            result = fn(self, *args, **kwargs)
            spent = time.perf_counter() - start
            bucket = totals[kind[0]]
            bucket["step"] += spent
            bucket[name] += spent
            if name == "execute_model":
                bucket["steps"] += 1
            for key, value in _now.items():
                bucket[key] += value
            return result

        return wrapper

    ModelRunner.execute_model = step(ModelRunner.execute_model, "execute_model")  # type: ignore[method-assign]
    ModelRunner.sample_tokens = step(ModelRunner.sample_tokens, "sample_tokens")  # type: ignore[method-assign]
    return totals


def shares(bucket: dict[str, float]) -> dict[str, float]:
    """Each category's share of the steps' time; "other torch" the rest of
    the forward."""
    timed = [k for k in bucket if k not in ("step", "steps", "execute_model", "sample_tokens")]
    out = {k: bucket[k] / bucket["step"] for k in sorted(timed, key=lambda k: -bucket[k])}
    out["sample_tokens"] = bucket["sample_tokens"] / bucket["step"]
    out["other torch"] = 1 - sum(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="2048: moe_vs_hf.py's"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dtype", default="float32", help="the engine's (auto: its default)")
    args = parser.parse_args()
    if not args.checkpoint.exists():
        from moe_vs_hf import write_checkpoint

        write_checkpoint(args.checkpoint)
    totals = instrument()
    result = trio.run(serve, args.checkpoint, 16, 128, 64, args.max_num_batched_tokens, args.dtype)
    report: dict[str, Any] = {"serve": result, "load_avg": os.getloadavg()}
    for name, bucket in totals.items():
        steps = max(bucket["steps"], 1)
        report[name] = {
            "steps": bucket["steps"],
            "ms_per_step": 1e3 * bucket["step"] / steps,
            "shares": shares(bucket),
        }
    report["engine_share_of_wall"] = 1 - sum(b["step"] for b in totals.values()) / result["wall_s"]
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
