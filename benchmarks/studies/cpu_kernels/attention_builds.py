"""The CPU library's paged attention (``cpu_kernels.c``) of two source trees
in one process, on a decode step of the embedded SmolLM2's shape across
all its layers: ``--layers`` KV caches (9 query / 3 KV heads, head_dim 64,
block size 16, float32 or bfloat16), ``--rows`` requests of one query token
each over contexts of ``--context`` keys (ragged: each request's length drawn
from [3/4, 1] of it), every layer's cache its own tensor, so a step reads
them all from memory as the engine's does (one layer's would stay in L3).
Each round runs the step (one kernel call per layer, store + rotary +
attend) with A, then B; figures: the best of ``--repeats`` rounds each, the
median of the rounds' B / A, and whether B's outputs equal A's bit for bit.
``--b-dtype`` gives B its own dtype (q, k, v and the KV cache: the same
values rounded), and the largest difference of B's outputs from A's.

``--layout`` is how a request's blocks lie in the cache: ``engine`` as the
engine's block pool hands them out to requests that prefill together and
then decode in step (each prompt's blocks consecutive, each later block one
of a block per request per 16 steps), ``random`` (a permutation of the pool).

    python3 benchmarks/studies/cpu_kernels/attention_builds.py /tmp/before . \\
        --rows 16 64 --threads 1 2
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import time
from pathlib import Path

import torch

from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.attention import CpuPagedAttention, CpuStepArgs

SOURCES = ("cpu_kernels.c", "cpu_quant.c", "cpu_decode.c", "cpu_dense.c")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(tree: Path, target: Path) -> CpuPagedAttention:
    """The tree's library (its attention sources), built with the library's flags."""
    sources = [str(tree / "asyncstep/ops/cpu" / name) for name in SOURCES]
    flags = [*library.BASE_FLAGS, *library.ISA_FLAGS["native"], "-fopenmp"]
    subprocess.run(["cc", *flags, *sources, "-o", str(target), *library.LIBS], check=True)
    return CpuPagedAttention(ctypes.CDLL(str(target)), target)


def block_tables(lens: list[int], layout: str, prompt: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, max blocks] int32 block ids: ``engine`` (prompt blocks consecutive
    per request, later blocks one per request in turn) or ``random``."""
    rows, width = len(lens), (max(lens) + BLOCK - 1) // BLOCK
    first = (prompt + BLOCK - 1) // BLOCK
    table = torch.zeros(rows, width, dtype=torch.int32)
    for r in range(rows):
        table[r, :first] = torch.arange(r * first, (r + 1) * first)
    for j in range(first, width):
        table[:, j] = rows * first + (j - first) * rows + torch.arange(rows)
    if layout == "random":
        order = torch.randperm(rows * width, generator=gen).to(torch.int32)
        table = order[table.long()]
    return table


def step_args(lens: list[int], table: torch.Tensor) -> CpuStepArgs:
    rows = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32)
    last = seq.long() - 1
    slots = table[torch.arange(rows), last // BLOCK].long() * BLOCK + last % BLOCK
    return CpuStepArgs.build(
        rows, torch.arange(rows + 1, dtype=torch.int32), seq, table, slots, last
    )


Inputs = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def step_inputs(rows: int, num_blocks: int, layers: int, dtype: torch.dtype) -> Inputs:
    """Every layer's KV cache, q, k, v (seeded: the same values in each
    dtype) and the output, of ``dtype``."""
    gen = torch.Generator().manual_seed(1)
    shape = (2, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]
    q = torch.randn(rows, HEADS * HEAD_DIM, generator=gen).to(dtype)
    kv = torch.randn(rows, 2 * KV_HEADS * HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty(rows, HEADS * HEAD_DIM, dtype=dtype)
    return caches, q, kv[:, : KV_HEADS * HEAD_DIM], kv[:, KV_HEADS * HEAD_DIM :], out


def timed_step(
    kernel: CpuPagedAttention, inputs: Inputs, step: CpuStepArgs, rotary: torch.Tensor, threads: int
) -> float:
    caches, q, k, v, out = inputs
    start = time.perf_counter()
    for cache in caches:
        kernel(out, q, k, v, cache, step, 0.125, rotary, num_threads=threads)
    return time.perf_counter() - start


def compared(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype == b.dtype:
        return f"same={torch.equal(a, b)}"
    return f"largest |B - A| {(b.float() - a.float()).abs().max():.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("a", type=Path, help="source tree A (the baseline)")
    parser.add_argument("b", type=Path, help="source tree B")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--prompt", type=int, default=128, help="keys in a request's first blocks")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--b-dtype", choices=sorted(DTYPES), help="B's (default: --dtype)")
    parser.add_argument("--layout", choices=("engine", "random"), default="engine")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--build-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    kernels = {
        "a": build(args.a, args.build_dir / "attention_builds_a.so"),
        "b": build(args.b, args.build_dir / "attention_builds_b.so"),
    }
    dtypes = {"a": DTYPES[args.dtype], "b": DTYPES[args.b_dtype or args.dtype]}
    gen = torch.Generator().manual_seed(0)
    rotary = torch.randn(args.context + 1, HEAD_DIM, generator=gen)
    print(
        f"{args.layers} layers, context {args.context} ({args.layout} blocks), "
        f"A {args.dtype}, B {args.b_dtype or args.dtype}; best of {args.repeats} rounds "
        "(A then B) and the median of the rounds' B/A"
    )
    for rows in args.rows:
        high = args.context + 1
        lens = [int(n) for n in torch.randint(args.context * 3 // 4, high, (rows,), generator=gen)]
        table = block_tables(lens, args.layout, args.prompt, gen)
        step = step_args(lens, table)
        inputs = {
            name: step_inputs(rows, int(table.max()) + 1, args.layers, dtype)
            for name, dtype in dtypes.items()
        }
        for threads in args.threads:
            times: dict[str, list[float]] = {"a": [], "b": []}
            for _ in range(args.repeats):
                for name in "ab":
                    times[name].append(
                        timed_step(kernels[name], inputs[name], step, rotary, threads)
                    )
            ta, tb = min(times["a"]), min(times["b"])
            ratio = statistics.median(y / x for x, y in zip(times["a"], times["b"], strict=True))
            kv_bytes = sum(lens) * KV_HEADS * HEAD_DIM * 2 * inputs["b"][0][0].element_size()
            print(
                f"rows {rows:4d} threads {threads}: A {ta * 1e3:7.2f} ms  B {tb * 1e3:7.2f} ms  "
                f"B/A {tb / ta:5.3f} (median {ratio:5.3f})  "
                f"B reads KV at {args.layers * kv_bytes / tb / 1e9:5.1f} GB/s  "
                + compared(inputs["a"][4], inputs["b"][4]),
                flush=True,
            )


if __name__ == "__main__":
    main()
