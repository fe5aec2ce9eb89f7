"""Per-call time of the dense matmuls' Python harness (dense.py and
dense_f32.py): those of a base checkout (A) against this tree's (B),
interleaved in one process on the same library (this tree's), a 1 x 64 @
64 x 64 matmul on one thread, where the harness's share of a call is largest.
Prints the medians and the minima of 300 blocks of 200 calls, and B / A.

    git archive <BASE> | tar -x -C /tmp/base
    PYTHONPATH=$PWD python3 benchmarks/studies/cpu_dense/harness_overhead.py /tmp/base $PWD
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from types import ModuleType
from typing import Any

import torch

from asyncstep.ops.cpu.library import load_cpu_kernels

BLOCKS, CALLS = 300, 200


def load(path: str, name: str) -> ModuleType:
    """The module at ``path``, imported as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matmuls(tree: str, tag: str, library: Any) -> dict[str, Any]:
    """The tree's two matmuls bound to ``library``."""
    dense = load(f"{tree}/asyncstep/ops/cpu/dense.py", f"{tag}_dense")
    f32 = load(f"{tree}/asyncstep/ops/cpu/dense_f32.py", f"{tag}_f32")
    return {"bf16": dense.CpuDenseMatmul(library), "f32": f32.CpuDenseF32Matmul(library)}


def block(matmul: Any, x: torch.Tensor, weight: torch.Tensor) -> float:
    """ns per call over one block of calls."""
    start = time.perf_counter_ns()
    for _ in range(CALLS):
        matmul(x, weight)
    return (time.perf_counter_ns() - start) / CALLS


def main() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU library does not build here"
    a = matmuls(sys.argv[1], "a", kernels.library)
    b = matmuls(sys.argv[2], "b", kernels.library)
    torch.set_num_threads(1)
    x = torch.randn(1, 64)
    weights = {"bf16": torch.randn(64, 64).bfloat16(), "f32": torch.randn(64, 64)}
    for kind, weight in weights.items():
        times: dict[str, list[float]] = {"a": [], "b": []}
        for r in range(BLOCKS):  # interleaved, the order alternating
            for tag in "ab" if r % 2 else "ba":
                times[tag].append(block((a if tag == "a" else b)[kind], x, weight))
        ma, mb = statistics.median(times["a"]), statistics.median(times["b"])
        la, lb = min(times["a"]), min(times["b"])
        print(
            f"{kind}: 1x64 @ 64x64, 1 thread: A {ma:.0f} ns/call, B {mb:.0f} (median, "
            f"B/A {mb / ma:.3f}); A {la:.0f}, B {lb:.0f} (min, B/A {lb / la:.3f})"
        )


if __name__ == "__main__":
    main()
