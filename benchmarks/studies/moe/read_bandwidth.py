"""The rate one and two threads read float32 from DRAM (torch's sum of 512
MiB, best of 5): the floor of a decode step of the MoE tiny model, which
streams its weights (the experts its tokens pick, the projections, the LM
head) once a step.

    python3 benchmarks/studies/moe/read_bandwidth.py
"""

from __future__ import annotations

import json
import os
import time

import torch


def read_rate(values: torch.Tensor, threads: int, repeats: int = 5) -> float:
    """GB/s of ``values.sum()`` on ``threads`` threads, its best of ``repeats``."""
    torch.set_num_threads(threads)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        values.sum()
        best = min(best, time.perf_counter() - start)
    return values.numel() * values.element_size() / best / 1e9


def main() -> None:
    values = torch.ones(128 << 20)
    report = {f"gb_s_{t}_threads": read_rate(values, t) for t in (1, 2)}
    print(json.dumps({**report, "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
