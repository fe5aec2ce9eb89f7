"""One gpt-oss-shaped sink layer's attention call on the CPU (the tiny
model's heads: 8 query heads of 64 over 2 KV heads; float32): the path
sink layers took before (torch's rotary, the reference's KV store and its
unplanned attention, as ``CpuAttention`` ran them) against the CPU
library's kernel now, decode batches of 1 and 8 at 256 keys, windowed (128)
and full, on 1 and 2 torch threads. The two alternate call by call; the
median and the minimum of each are printed as a JSON line (on a loaded
machine torch's parallel regions stall on a descheduled thread: the
median then says more about the load than the minimum does).

Usage: python benchmarks/studies/sinks/attention_op.py [REPEATS]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from asyncstep.ops.attention import AttentionMetadata, AttentionShape
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.paged_attention import CpuAttention
from asyncstep.ops.torch_attention import reference_attention, write_kv_cache
from asyncstep.ops.torch_ref import TORCH_OPS
from tests.models.test_cpu_attention import make_step

HEADS, KV_HEADS, DIM, BLOCK, CONTEXT = 8, 2, 64, 16, 255


def reference_path(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    shape: AttentionShape,
    cos_sin_cache: torch.Tensor,
) -> torch.Tensor:
    """What ``CpuAttention`` ran for a sink layer before the kernel took sinks."""
    n = meta.num_actual_tokens
    assert meta.positions is not None
    cos_sin = TORCH_OPS.rotary_cos_sin(cos_sin_cache, meta.positions[:n], q.dtype)
    q, k = TORCH_OPS.rotary(cos_sin, q[:n], k[:n], cos_sin_cache, shape.head_dim)
    q = q.reshape(n, shape.num_heads, shape.head_dim)
    k = k.reshape(n, shape.num_kv_heads, shape.head_dim)
    v = v[:n].reshape(n, shape.num_kv_heads, shape.head_dim)
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    out = reference_attention(
        q, k, v, kv_cache, meta, shape.scale, shape.sliding_window, shape.sinks, planned=False
    )
    return out.reshape(n, -1)


def timed(fn: Callable[..., object], args: tuple[object, ...], times: list[float]) -> None:
    """``fn(*args)``'s wall milliseconds, appended to ``times``."""
    start = time.perf_counter()
    fn(*args)
    times.append(1e3 * (time.perf_counter() - start))


def main(repeats: int) -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU library does not build here"
    op = CpuAttention(kernels.attention)
    sinks = torch.linspace(-1.0, 2.0, HEADS)
    cos_sin_cache = torch.randn(CONTEXT + 1, DIM)
    for threads, batch in ((1, 1), (1, 8), (2, 1), (2, 8)):
        torch.set_num_threads(threads)
        step = make_step(
            [1] * batch, [CONTEXT] * batch, heads=HEADS, kv_heads=KV_HEADS, dim=DIM,
            block=BLOCK, dtype=torch.float32, seed=0,
        )  # fmt: skip
        for window in (128, None):
            shape = AttentionShape(HEADS, KV_HEADS, DIM, DIM**-0.5, window, sinks)
            args = (step.q, step.k, step.v, step.kv_cache, step.meta, shape, cos_sin_cache)
            before: list[float] = []
            after: list[float] = []
            for _ in range(repeats):
                timed(reference_path, args, before)
                timed(op, args, after)
            ref_ms, kernel_ms = statistics.median(before), statistics.median(after)
            print(json.dumps({
                "batch": batch, "keys": CONTEXT + 1, "window": window, "threads": threads,
                "reference_median_ms": round(ref_ms, 4), "kernel_median_ms": round(kernel_ms, 4),
                "reference_min_ms": round(min(before), 4), "kernel_min_ms": round(min(after), 4),
                "speedup_median": round(ref_ms / kernel_ms, 1),
                "speedup_min": round(min(before) / min(after), 1),
            }))  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
