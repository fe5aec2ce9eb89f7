"""The dense bfloat16 matmul (``cpu_dense.c``, the library's flags) with
each ``outer_min_rows`` given (where the AVX512-BF16 build's outer products
start; 0: the build's own 32), timed on the MoE tiny model's LM head
(32768 x 512) and a projection (1536 x 512) at 2 to 16 rows of x: ms, best
of a few, in the order given (repeat them to alternate).

    PYTHONPATH=. python3 outer_rows.py SOURCE.c 0 4 16 0 4 16
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.dense import CpuDenseMatmul

ROWS = [2, 4, 8, 9, 12, 16]


def best_ms(matmul: CpuDenseMatmul, x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    matmul(x, w)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        matmul(x, w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    source, starts = Path(sys.argv[1]), [int(a) for a in sys.argv[2:]] or [0]
    torch.manual_seed(0)
    head, proj = torch.randn(32768, 512).bfloat16(), torch.randn(1536, 512).bfloat16()
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "dense.so"
        command = ["cc", *library.BASE_FLAGS, "-march=native", "-fopenmp"]
        command += [f"-I{source.parent}", str(source), "-o", str(target), "-lm"]
        subprocess.run(command, check=True)
        matmul = CpuDenseMatmul(ctypes.CDLL(str(target)))
        for start in starts:
            matmul.outer_min_rows = start
            cells = []
            for rows in ROWS:
                x = torch.randn(rows, 512)
                cells.append(f"{rows}h {best_ms(matmul, x, head, 8):.3f}")
                cells.append(f"{rows}p {best_ms(matmul, x, proj, 30):.3f}")
            print(f"outer_min_rows {start}:", " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
