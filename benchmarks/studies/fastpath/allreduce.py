"""TP all-reduce cost on two GPUs, inside CUDA graphs (as a decode step runs
it): NCCL against torch's symmetric-memory one-shot and two-shot all-reduce
(peer loads over NVLink, no multicast), per hidden-state size.

    python benchmarks/studies/fastpath/allreduce.py --out benchmarks/results/fastpath/allreduce.json

Each variant's graph holds ``--per-graph`` all-reduces of one size (a llama-8b
decode step runs 64 at TP = 2); the figure is the median replay time over
that count. Every variant's sum is checked against the expected one first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096  # llama-8b


def time_graph(fn: Callable[[], None], per_graph: int, repeats: int) -> float:
    """Median µs per call of ``fn`` replayed ``per_graph`` times in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    return statistics.median(times)


def variants(x: torch.Tensor, group: dist.ProcessGroup) -> dict[str, Callable[[], torch.Tensor]]:
    """Name -> a function returning the sum of ``x`` over the group."""
    out: dict[str, Callable[[], torch.Tensor]] = {}
    nccl_buf = x.clone()

    def nccl() -> torch.Tensor:
        nccl_buf.copy_(x)
        dist.all_reduce(nccl_buf, group=group)
        return nccl_buf

    out["nccl"] = nccl
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, name)
        result = torch.empty_like(x)

        def one_shot() -> torch.Tensor:
            buf.copy_(x.view(-1))
            result.view(-1).copy_(torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name))
            return result

        def two_shot() -> torch.Tensor:
            buf.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)
            return buf.view(x.shape)

        out["symm_one_shot"] = one_shot
        out["symm_two_shot"] = two_shot
    except Exception as exc:  # report it and go on with NCCL
        print(f"symmetric memory unavailable: {exc!r}", file=sys.stderr, flush=True)
    return out


def worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    group = dist.new_group([0, 1])
    rows = []
    for tokens in args.tokens:
        x = torch.full((tokens, HIDDEN), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        for name, fn in variants(x, group).items():
            ok = bool((fn() == 3.0).all())  # 1 + 2
            try:
                us = time_graph(fn, args.per_graph, args.repeats) if ok else float("nan")
            except Exception as exc:  # report it and go on with NCCL
                print(f"{name} at {tokens} tokens: {exc!r}", file=sys.stderr, flush=True)
                us = float("nan")
            rows.append(
                {"tokens": tokens, "bytes": x.numel() * 2, "variant": name, "correct": ok, "us": us}
            )
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--per-graph", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA devices", file=sys.stderr)
        return 1
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, args.port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    print(f"{'tokens':>6} {'bytes':>9} {'variant':>14} {'ok':>3} {'us/all-reduce':>14}")
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['bytes']:>9} {r['variant']:>14} {r['correct']!s:>3} "
            f"{r['us']:>14.2f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "date": datetime.now(UTC).isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(0),
                    "torch": torch.__version__,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
