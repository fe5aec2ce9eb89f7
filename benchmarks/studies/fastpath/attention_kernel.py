"""GPU micro-benchmark of ``paged_attention`` decode (llama-8b heads: 32 q / 8 kv,
head_dim 128, bf16, block size 16, random block ids): eager (median CUDA-event
time after warm-up) and in a CUDA graph of 10 calls (per call), as K+V read
bandwidth, against torch SDPA on the same K/V made contiguous (also the check).
--tile-n etc. override the decode launch options, for tuning; --layers L
gives the graph's calls L distinct caches in turn (as a model's layers: the
keys stream from HBM, not L2). E.g.
    python benchmarks/studies/fastpath/attention_kernel.py \\
        --out benchmarks/results/attention_kernel_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from asyncstep.ops.triton import attention as ta

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, GRAPH_CALLS = 32, 8, 128, 16, 10
OVERRIDES = ("tile_n", "num_splits", "num_warps", "num_stages")
TIMED = ("eager", "graph", "sdpa")  # paged_attention eager, in a graph; SDPA eager


def median_us(fn: Any, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end, times = torch.cuda.Event(True), torch.cuda.Event(True), []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_us(fns: list[Any], iters: int, warmup: int) -> float:
    """Per call, GRAPH_CALLS calls in one graph, going round ``fns``."""
    for fn in fns:
        fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            fns[i % len(fns)]()
    return median_us(graph.replay, iters, warmup) / GRAPH_CALLS


def setup(
    batch: int, ctx: int, dev: torch.device, dt: torch.dtype, layers: int = 1
) -> tuple[Any, Any, Any, list[Any]]:
    """(paged decode call, SDPA call on the same K/V made contiguous, output,
    the paged call on each of ``layers`` caches: the first and more)."""
    per_req = -(-ctx // BLOCK)
    caches = [
        torch.randn(2, KV_HEADS, batch * per_req, BLOCK, HEAD_DIM, device=dev, dtype=dt)
        for _ in range(layers)
    ]
    kv = caches[0]
    table = torch.randperm(batch * per_req, device=dev).view(batch, per_req).int()
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=dev, dtype=dt)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    out, scale = torch.empty_like(q), HEAD_DIM**-0.5
    # [batch, kv_heads, ctx, head_dim]
    k, v = (kv[i][:, table.long()].flatten(2, 3)[:, :, :ctx].transpose(0, 1) for i in (0, 1))
    k, v, q4 = k.contiguous(), v.contiguous(), q.unsqueeze(2)
    per_layer = [
        lambda c=c: ta.paged_attention(q, c, qsl, seq_lens, table, scale, out=out) for c in caches
    ]
    return (
        per_layer[0],
        lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True),
        out,
        per_layer,
    )


def bench(batch: int, ctx: int, iters: int, warmup: int, layers: int = 1) -> dict[str, Any]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    paged, sdpa, out, per_layer = setup(batch, ctx, dev, dt, layers)
    paged()  # compiles
    err = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
    launch = ta._decode_launch(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM, dt, ta._num_sms(dev))
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    row: dict[str, Any] = {"batch": batch, "context": ctx, "max_abs_err": err}
    row |= {f"launch_{f.name}": getattr(launch, f.name) for f in dataclasses.fields(launch)}
    for name, fn in zip(TIMED, (paged, paged, sdpa), strict=True):
        us = graph_us(per_layer, iters, warmup) if name == "graph" else median_us(fn, iters, warmup)
        row[f"{name}_us"], row[f"{name}_gbps"] = us, kv_bytes / us / 1e3
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--iters", type=int, default=100, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed runs first")
    parser.add_argument("--layers", type=int, default=1, help="distinct caches in the graph")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    for name in OVERRIDES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="override (tuning)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernel.py needs a CUDA GPU (the Triton kernels are compiled for it)")
    changes = {n: getattr(args, n) for n in OVERRIDES if getattr(args, n) is not None}
    if changes:
        choose = ta._decode_launch
        ta._decode_launch = lambda *a: dataclasses.replace(choose(*a), **changes)
    rows = []
    print(f"{torch.cuda.get_device_name()}, overrides {changes or 'none'}")
    print("batch context splits  eager us  GB/s  graph us  GB/s   sdpa us  GB/s   max err")
    for batch in args.batches:
        for ctx in args.contexts:
            rows.append(r := bench(batch, ctx, args.iters, args.warmup, args.layers))
            line = [f"{batch:5d} {ctx:7d} {r['launch_num_splits']:6d}"]
            line += [f"{r[f'{k}_us']:9.1f} {r[f'{k}_gbps']:5.0f}" for k in TIMED]
            print(*line, f"{r['max_abs_err']:.1e}")
            torch.cuda.empty_cache()
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "overrides": changes}
        args.out.write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
