"""A greedy step's argmax on the CPU: torch's ``argmax`` against numpy's (what
:func:`asyncstep.runner.sampler.argmax_rows` takes for float32 rows), SmolLM2's
vocabulary, 1 / 16 / 64 rows, microseconds a call (mean of ``--calls``).

    python3 benchmarks/studies/cpu_kernels/argmax_rows.py
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for rows in (1, 16, 64):
        x = torch.randn(rows, args.vocab)
        ours = timed(lambda x=x: torch.from_numpy(x.numpy().argmax(axis=-1)), args.calls)
        theirs = timed(lambda x=x: x.argmax(dim=-1), args.calls)
        print(f"rows {rows:3d}: torch {theirs:8.1f} us  numpy {ours:8.1f} us  {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
