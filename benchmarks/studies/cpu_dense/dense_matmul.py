"""CPU micro-benchmark of the library's dense bfloat16 matmul
(``cpu_dense.c``: a fixed K order for every row count) against torch's
``F.linear`` in bfloat16 (oneDNN) on the embedded SmolLM2-135M's
projections (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576,
LM head 576->49152) at 1, 4, 16, 64 and 256 rows, with 1 and 2 torch
threads. ``ours`` takes bfloat16 x and writes bfloat16 (the layers' call);
``ours_f32`` takes float32 x and writes float32 (the head's call).

Variants run interleaved (each round times every variant; a figure is the
best call over ``--rounds`` x ``--repeats``), so a busy machine slows them
alike: read the ratios. E.g.

    python benchmarks/studies/cpu_dense/dense_matmul.py \\
        --out benchmarks/results/cpu/dense_1205/dense_matmul.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncstep.ops.cpu.dense import dense_matmul

SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
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
    matmul = dense_matmul()
    assert matmul is not None, "the CPU library does not load"
    torch.set_num_threads(threads)
    results = []
    for name in shapes:
        k, n = SHAPES[name]
        weight = (torch.randn(n, k) * 0.05).bfloat16()
        for rows in ROWS:
            x = torch.randn(rows, k).bfloat16()
            xf = x.float()
            variants: dict[str, Callable[[], object]] = {
                "torch": partial(F.linear, x, weight),
                "ours": partial(matmul, x, weight, torch.bfloat16),
                "ours_f32": partial(matmul, xf, weight),
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
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    matmul = dense_matmul()
    results = [
        row for t in args.threads for row in measure(t, args.rounds, args.repeats, args.shapes)
    ]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"isa": matmul.isa if matmul else None, "results": results}
        args.out.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
