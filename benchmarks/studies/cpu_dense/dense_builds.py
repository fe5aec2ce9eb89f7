"""The dense matmul's AVX2 build against its AVX512-BF16 build and torch's
bf16 ``F.linear`` (the embedded model's gate_up, 576 -> 3072, one thread):
why dense bfloat16 runs the library's matmul by default only where the
AVX512-BF16 build runs (the others compute a row at a time).

    python3 benchmarks/studies/cpu_dense/dense_builds.py
"""

from __future__ import annotations

import ctypes
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

import asyncstep
from asyncstep.ops.cpu.dense import CpuDenseMatmul

BUILDS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"], "AVX512-BF16": ["-march=native"]}


def build(isa: str) -> CpuDenseMatmul:
    source = Path(asyncstep.__file__).parent / "ops/cpu/cpu_dense.c"
    target = f"/tmp/dense_{isa}.so"
    flags = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", *BUILDS[isa]]
    subprocess.run(["cc", *flags, str(source), "-o", target], check=True)
    return CpuDenseMatmul(ctypes.CDLL(target))


def best_us(call: Callable[[], object], repeats: int = 5) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    torch.set_num_threads(1)
    builds = {isa: build(isa) for isa in BUILDS}
    weight = torch.randn(3072, 576).bfloat16()
    for rows in (1, 16, 64, 256):
        x = torch.randn(rows, 576)
        x16 = x.bfloat16()
        torch_us = best_us(lambda x16=x16: torch.nn.functional.linear(x16, weight))
        ours = {isa: best_us(lambda m=m, x=x: m(x, weight)) for isa, m in builds.items()}
        shown = "  ".join(f"{k} {v:8.1f} us ({torch_us / v:.2f}x)" for k, v in ours.items())
        print(f"gate_up rows {rows:4d}: torch bf16 {torch_us:8.1f} us  {shown}")


if __name__ == "__main__":
    main()
