"""GPU micro-benchmark of the fused Triton kernels against what they replace:
add + ``F.rms_norm`` vs ``fused_add_rms_norm``; ``RotaryEmbedding``
(``cos_sin`` + forward) vs ``rotary_embedding`` (in place on slices of a fused
qkv); ``F.silu(gate) * up`` vs ``silu_and_mul`` (on a [tokens, 2 * intermediate]
gate_up output); and the two unfused Triton kernels ``rotary_embedding`` +
``store_kv_cache`` (in the "torch" columns) vs ``rotary_and_store_kv`` (into a
paged cache of 16-token blocks, distinct random slots). Eager (median of
CUDA-event timings after warm-up, launch overhead included) and inside a CUDA
graph (16 calls captured in one graph, per call).
32 q heads and 8 kv heads: hidden 2048 with head_dim 64 and intermediate 8192
(llama-3.2-1b), 4096 with 128 and 14336 (llama-3.1-8b).

    python benchmarks/studies/fastpath/fused_kernels.py \\
        --out benchmarks/results/fused_kernels_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from asyncstep.models.layers.rotary import RotaryEmbedding

GRAPH_CALLS = 16
Q_HEADS, KV_HEADS = 32, 8
SHAPES = ((2048, 64), (4096, 128))  # (hidden, head_dim)
INTERMEDIATE = {2048: 8192, 4096: 14336}  # hidden -> MLP intermediate size
BLOCK_SIZE = 16  # KV-cache block size (tokens)


def median_us(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_us(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return median_us(graph.replay, iters, warmup) / GRAPH_CALLS


def cases(tokens: int, hidden: int, head_dim: int, dtype: torch.dtype) -> dict[str, Any]:
    import triton

    from asyncstep.ops.triton.attention import store_kv_cache
    from asyncstep.ops.triton.fused import fused_add_rms_norm, silu_and_mul
    from asyncstep.ops.triton.rotary import rotary_and_store_kv, rotary_embedding

    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    residual = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    rope = RotaryEmbedding(head_dim, 8192, 500000.0).cuda()
    qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * head_dim, device="cuda", dtype=dtype)
    q, k = qkv[:, : Q_HEADS * head_dim], qkv[:, Q_HEADS * head_dim : -KV_HEADS * head_dim]
    v = qkv[:, -KV_HEADS * head_dim :]
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE[hidden], device="cuda", dtype=dtype)
    num_blocks = 2 * triton.cdiv(tokens, BLOCK_SIZE)
    kv_cache = torch.zeros(
        2, KV_HEADS, num_blocks, BLOCK_SIZE, head_dim, device="cuda", dtype=dtype
    )
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
    kv_shape = (tokens, KV_HEADS, head_dim)

    def torch_silu_and_mul() -> torch.Tensor:
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up

    def unfused_rotary_and_store() -> None:
        rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim)
        store_kv_cache(k.view(kv_shape), v.view(kv_shape), kv_cache, slots)

    return {
        "add_rms_norm": (
            lambda: F.rms_norm(residual + x, (hidden,), weight, 1e-5),
            lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
        ),
        "rotary": (
            lambda: rope(rope.cos_sin(positions, dtype), q, k),
            lambda: rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim),
        ),
        "silu_and_mul": (torch_silu_and_mul, lambda: silu_and_mul(gate_up)),
        "rotary_store_kv": (
            unfused_rotary_and_store,
            lambda: rotary_and_store_kv(
                positions, q, k, v, rope.cos_sin_cache, head_dim, kv_cache, slots
            ),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Fused Triton kernels vs torch, on CUDA.")
    parser.add_argument("--out", type=Path, default=Path("fused_kernels.json"))
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256, 2048])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("fused_kernels.py needs a CUDA device (and TRITON_INTERPRET unset): nothing run")
    import triton

    dtype = getattr(torch, args.dtype)
    rows = []
    head = f"{'op':<16}{'tokens':>7}{'hidden':>7}  {'torch':>8}{'fused':>8}{'x':>6}"
    print(f"{head}  {'torch/g':>8}{'fused/g':>8}{'x':>6}   (us per call; /g: in a CUDA graph)")
    for hidden, head_dim in SHAPES:
        for tokens in args.tokens:
            for op, (torch_fn, fused_fn) in cases(tokens, hidden, head_dim, dtype).items():
                t = {
                    f"{impl}_{mode}_us": timer(fn, args.iters, args.warmup)
                    for impl, fn in (("torch", torch_fn), ("fused", fused_fn))
                    for mode, timer in (("eager", median_us), ("graph", graph_us))
                }
                rows.append(
                    {"op": op, "tokens": tokens, "hidden": hidden, "head_dim": head_dim, **t}
                )
                eager_x = t["torch_eager_us"] / t["fused_eager_us"]
                graph_x = t["torch_graph_us"] / t["fused_graph_us"]
                print(
                    f"{op:<16}{tokens:>7}{hidden:>7}  {t['torch_eager_us']:>8.2f}"
                    f"{t['fused_eager_us']:>8.2f}{eager_x:>6.2f}  {t['torch_graph_us']:>8.2f}"
                    f"{t['fused_graph_us']:>8.2f}{graph_x:>6.2f}"
                )
    meta: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    meta |= {"triton": triton.__version__, "dtype": args.dtype, "iters": args.iters}
    meta |= {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "graph_calls": GRAPH_CALLS}
    meta |= {"intermediate": INTERMEDIATE, "block_size": BLOCK_SIZE}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
