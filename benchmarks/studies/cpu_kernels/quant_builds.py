"""The CPU library's quantized matmul (``cpu_quant.c``) of two source trees
in one process: each tree's library built with the library's flags into
``--build-dir``, SmolLM2's shapes (30 layers' four Q4 projections and the Q8
LM head, random GGUF-like weights) timed alternately A, B, A, B, ... at
each row count, the best of ``--repeats`` each, and the ratio B / A (of the
bests, and the median of the rounds' ratios); also
whether B's output equals A's bit for bit, B's rate against ``--peak`` (one
core's ``vpdpbusd`` rate in G int8 multiply-adds a second, times the
threads; ``peak/vnni_peak.c`` measures it) and, with ``--torch``, torch's
bfloat16 ``F.linear`` of the same shape (oneDNN) timed in the same rounds.
Alternating in one process keeps a busy machine's noise out of the ratio.
``--dram-mb M``: each call reads its own copy of the weight, enough copies
for M MB (past the last-level cache, as a decode step reads its weights
from memory), a timing then a pass over every copy (per call: divided).

    python3 benchmarks/studies/cpu_kernels/quant_builds.py /tmp/before . --threads 1
    python3 benchmarks/studies/cpu_kernels/quant_builds.py /tmp/before . \\
        --rows 1 16 64 256 2048 --torch --peak 235
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from cpu_quant_matmul import q4_weight, q8_weight

from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.quant import CpuQuantMatmul, pack_q4_cpu, pack_q8_cpu

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
SOURCES = ("cpu_kernels.c", "cpu_quant.c", "cpu_decode.c", "cpu_dense.c")


def build(tree: Path, target: Path) -> CpuQuantMatmul:
    sources = [str(tree / "asyncstep/ops/cpu" / name) for name in SOURCES]
    flags = [*library.BASE_FLAGS, *library.ISA_FLAGS["native"], "-fopenmp"]
    subprocess.run(["cc", *flags, *sources, "-o", str(target), *library.LIBS], check=True)
    return CpuQuantMatmul(ctypes.CDLL(str(target)))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("a", type=Path, help="source tree A (the baseline)")
    parser.add_argument("b", type=Path, help="source tree B")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--levels", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", help="row counts (default: per shape)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--peak", type=float, default=235.0, help="G multiply-adds/s a core")
    parser.add_argument("--torch", action="store_true", help="also time bf16 F.linear")
    parser.add_argument("--build-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--dram-mb", type=float, default=0.0, help="copies of W past the cache")
    args = parser.parse_args()
    a = build(args.a, args.build_dir / "quant_builds_a.so")
    b = build(args.b, args.build_dir / "quant_builds_b.so")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    peak = args.peak * args.threads
    print(
        f"threads {args.threads}, levels {args.levels}, best of {args.repeats} (and the median "
        f"of the pairs' B/A), alternating; "
        f"peak {peak:.0f} G/s"
    )
    for name in args.shapes:
        n, k = SHAPES[name]
        head = name == "head"
        weight = (q8_weight if head else q4_weight)(n, k, gen)
        packed = (pack_q8_cpu if head else pack_q4_cpu)(weight, torch.float32, 4096, args.levels)
        assert packed is not None
        nbytes = sum(
            t.numel() * t.element_size() for t in vars(packed).values() if torch.is_tensor(t)
        )
        copies = [packed] + [copy.deepcopy(packed) for _ in range(int(args.dram_mb * 1e6 / nbytes))]
        dense = weight.to(torch.bfloat16)
        for rows in args.rows or ((1, 16, 64) if head else (1, 64, 256, 2048)):
            x = torch.randn(rows, k, generator=gen)
            xb = x.to(torch.bfloat16)
            same = torch.equal(a(packed, x), b(packed, x))
            tt = float("inf")
            times_a: list[float] = []
            times_b: list[float] = []
            calls = len(copies)
            for _ in range(args.repeats):
                times_a.append(timed(lambda: [a(c, x) for c in copies]) / calls)  # noqa: B023
                times_b.append(timed(lambda: [b(c, x) for c in copies]) / calls)  # noqa: B023
                if args.torch:
                    tt = min(tt, timed(lambda: F.linear(xb, dense)))  # noqa: B023
            ta, tb = min(times_a), min(times_b)
            pairs = statistics.median(y / z for y, z in zip(times_b, times_a, strict=True))
            rate = args.levels * rows * n * k / tb / 1e9
            gbs = nbytes / tb / 1e9
            line = (
                f"{name:8s} rows {rows:5d}: A {ta * 1e3:8.3f} ms  B {tb * 1e3:8.3f} ms  "
                f"B/A {tb / ta:5.3f} (median of pairs {pairs:5.3f})  "
                f"B {rate:6.1f} G int8 multiply-adds/s "
                f"({100 * rate / peak:3.0f} % of peak)  B reads {gbs:5.1f} GB/s  same={same}"
            )
            if args.torch:
                line += f"  torch bf16 {tt * 1e3:8.3f} ms (B/torch {tb / tt:5.2f})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
