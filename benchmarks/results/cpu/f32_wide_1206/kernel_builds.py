"""The float32 matmul (``cpu_dense_f32.c``) and the MoE experts
(``cpu_moe.c``) built from given sources with given macros, timed on the MoE
tiny model's shapes: ms and GFLOP/s (best of a few), one build after another.

    PYTHONPATH=. python3 kernel_builds.py dense SOURCE.c [SOURCE.c ...] \\
        [--defs=-DPREFETCH=0 --defs= ...]
    PYTHONPATH=. python3 kernel_builds.py moe SOURCE.c [SOURCE.c ...]

Each source is built with the library's flags (``-march=native``, OpenMP)
and each ``--defs`` in turn (a space-separated list of macros; none, or
``--defs=``: the source's defaults). The experts run
8 layers of distinct weights at 16 rows (a decode step's: the weights come
from DRAM) and 2 layers at 2,048 (a prefill's).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.dense_f32 import CpuDenseF32Matmul
from asyncstep.ops.cpu.moe import CpuMoeExperts, moe_router

H = 512
DENSE_SHAPES = [(1, 32768), (4, 32768), (16, 32768), (64, 32768), (16, 1024), (2048, 1024)]


def build(source: Path, defs: str, target: Path) -> ctypes.CDLL:
    command = ["cc", *library.BASE_FLAGS, "-march=native", "-fopenmp", *defs.split()]
    command += [f"-I{source.parent}", str(source), "-o", str(target), "-lm"]
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(target))


def best_seconds(fn: object, reps: int) -> float:
    assert callable(fn)
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def dense(lib: ctypes.CDLL) -> str:
    mm = CpuDenseF32Matmul(lib)
    cells = []
    for rows, n in DENSE_SHAPES:
        x, w = torch.randn(rows, H), torch.randn(n, H)
        flop = 2 * rows * n * H
        seconds = best_seconds(lambda: mm(x, w), max(5, int(2e9 / flop)))  # noqa: B023
        cells.append(f"{rows}x{n} {seconds * 1e3:.2f} ms {flop / seconds / 1e9:.0f} GF")
    return " | ".join(cells)


def moe(lib: ctypes.CDLL) -> str:
    experts, router = CpuMoeExperts(lib), moe_router()
    assert router is not None
    layers = 8
    w13 = [torch.randn(32, 512, H) * 0.05 for _ in range(layers)]
    w2 = [torch.randn(32, H, 256) * 0.05 for _ in range(layers)]
    cells = []
    for tokens, used in ((16, layers), (2048, 2)):
        x = torch.randn(tokens, H)
        routes = [router(torch.randn(tokens, 32), 4, renormalize=True) for _ in range(used)]

        def run(x: torch.Tensor = x, routes: list = routes, used: int = used) -> None:
            for i in range(used):
                experts(x, w13[i], w2[i], routes[i][0], routes[i][1])

        seconds = best_seconds(run, 5 if tokens == 16 else 2) / used
        flop = 2 * tokens * 4 * 3 * H * 256
        cells.append(f"T={tokens} {seconds * 1e3:.2f} ms/layer {flop / seconds / 1e9:.0f} GF")
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["dense", "moe"])
    parser.add_argument("sources", nargs="+", type=Path)
    parser.add_argument("--defs", action="append", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for i, source in enumerate(args.sources):
            for j, defs in enumerate(args.defs or [""]):
                lib = build(source, defs, Path(tmp) / f"k{i}_{j}.so")
                line = dense(lib) if args.kernel == "dense" else moe(lib)
                print(f"{source.name} {defs or '(defaults)'}: {line}", flush=True)


if __name__ == "__main__":
    main()
