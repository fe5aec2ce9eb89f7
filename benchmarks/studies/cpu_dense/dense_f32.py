"""CPU micro-benchmark of the library's dense float32 matmul
(``cpu_dense_f32.c``: one K order for every row count, thread count and
build) against torch's float32 ``F.linear`` (MKL / oneDNN sgemm) on the MoE
tiny model's float32 shapes (``benchmarks/studies/moe/moe_vs_hf.py``:
qkv 512->1024, o 512->512, router 512->32, LM head 512->32768) at 1, 4,
16, 64 and 256 rows, with 1 and 2 torch threads.

``--invariance`` instead: for each shape, whether 64 rows' outputs in
batches of 2, 16 and 64 equal each row's alone, bit for bit, for torch and
for ours.

Variants run interleaved (each round times every variant; a figure is the
best call over ``--rounds`` x ``--repeats``), so a busy machine slows them
alike: read the ratios. E.g.

    python3 benchmarks/studies/cpu_dense/dense_f32.py \\
        --out benchmarks/results/cpu/f32dense_1205/dense_f32.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncstep.ops.cpu.dense_f32 import dense_f32_matmul

SHAPES = {
    "qkv": (512, 1024),
    "o": (512, 512),
    "router": (512, 32),
    "lm_head": (512, 32768),
}
ROWS = (1, 4, 16, 64, 256)


def best_seconds(call: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure(threads: int, rounds: int, repeats: int, shapes: list[str]) -> list[dict[str, object]]:
    matmul = dense_f32_matmul()
    assert matmul is not None, "the CPU library does not load"
    torch.set_num_threads(threads)
    results = []
    for name in shapes:
        k, n = SHAPES[name]
        weight = torch.randn(n, k) * 0.05
        for rows in ROWS:
            x = torch.randn(rows, k)
            variants: dict[str, Callable[[], object]] = {
                "torch": partial(F.linear, x, weight),
                "ours": partial(matmul, x, weight),
            }
            best = dict.fromkeys(variants, float("inf"))
            for _ in range(rounds):
                for key, call in variants.items():
                    best[key] = min(best[key], best_seconds(call, repeats))
            flops = 2 * rows * k * n
            row = {
                "shape": name,
                "k": k,
                "n": n,
                "rows": rows,
                "threads": threads,
                **{f"{key}_us": round(s * 1e6, 1) for key, s in best.items()},
                "ours_gflops": round(flops / best["ours"] / 1e9, 1),
                "torch_gflops": round(flops / best["torch"] / 1e9, 1),
                "torch_over_ours": round(best["torch"] / best["ours"], 2),
                "load_avg": os.getloadavg()[0],
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def invariance(shapes: list[str]) -> list[dict[str, object]]:
    """Per shape and batch: whether each matmul's rows equal the rows alone."""
    matmul = dense_f32_matmul()
    assert matmul is not None, "the CPU library does not load"
    results = []
    for name in shapes:
        k, n = SHAPES[name]
        weight = torch.randn(n, k) * 0.05
        x = torch.randn(64, k)
        for key, call in (("torch", F.linear), ("ours", matmul)):
            alone = torch.cat([call(x[r : r + 1], weight) for r in range(64)])
            for batch in (2, 16, 64):
                same = torch.equal(call(x[:batch], weight), alone[:batch])
                row = {"shape": name, "matmul": key, "batch": batch, "rows_equal_alone": same}
                print(json.dumps(row), flush=True)
                results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--invariance", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    matmul = dense_f32_matmul()
    if args.invariance:
        results = invariance(args.shapes)
    else:
        results = [
            row for t in args.threads for row in measure(t, args.rounds, args.repeats, args.shapes)
        ]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"isa": matmul.isa if matmul else None, "results": results}
        args.out.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
