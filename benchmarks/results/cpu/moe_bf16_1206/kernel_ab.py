"""The MoE experts (``cpu_moe.c``) from given sources, timed on the MoE tiny
model's decode shape (16 rows, 32 experts, top 4, H 512, I 256; 8 layers of
distinct weights, so they come from DRAM) with float32 and with bfloat16
weights: ms a layer and GB/s of weights read (best of a few), one source
after another, rounds in turn.

    PYTHONPATH=. python3 kernel_ab.py [--rounds N] SOURCE.c [SOURCE.c ...]

Each source is built with the library's flags (``-march=native``, OpenMP),
beside the headers of its own directory.
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
from asyncstep.ops.cpu.moe import CpuMoeExperts, moe_router

H, INTER, E, K, ROWS, LAYERS = 512, 256, 32, 4, 16, 8


def build(source: Path, target: Path) -> ctypes.CDLL:
    command = ["cc", *library.BASE_FLAGS, "-march=native", "-fopenmp"]
    command += [f"-I{source.parent}", str(source), "-o", str(target), "-lm"]
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(target))


def time_layers(experts: CpuMoeExperts, dtype: torch.dtype) -> tuple[float, float]:
    """Seconds a layer (best of 7 passes over the 8 layers) and GB/s of weights."""
    router = moe_router()
    assert router is not None
    torch.manual_seed(0)
    w13 = [(torch.randn(E, 2 * INTER, H) * 0.05).to(dtype) for _ in range(LAYERS)]
    w2 = [(torch.randn(E, H, INTER) * 0.05).to(dtype) for _ in range(LAYERS)]
    x = torch.randn(ROWS, H)
    routes = [router(torch.randn(ROWS, E), K, renormalize=True) for _ in range(LAYERS)]
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for i in range(LAYERS):
            experts(x, w13[i], w2[i], routes[i][0], routes[i][1])
        best = min(best, (time.perf_counter() - start) / LAYERS)
    used = {int(e) for _, ids in routes[:1] for e in ids.flatten()}
    weight_bytes = len(used) * 3 * INTER * H * w13[0].element_size()
    return best, weight_bytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(s, Path(tmp) / f"k{i}.so") for i, s in enumerate(args.sources)]
        for r in range(args.rounds):
            for source, lib in zip(args.sources, libs, strict=True):
                cells = []
                for dtype in (torch.float32, torch.bfloat16):
                    seconds, rate = time_layers(CpuMoeExperts(lib), dtype)
                    cells.append(f"{str(dtype)[6:]} {seconds * 1e3:.3f} ms/layer {rate:.1f} GB/s")
                print(f"round {r + 1} {source}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
