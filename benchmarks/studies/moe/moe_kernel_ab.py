"""The CPU library's experts (``cpu_moe.c``) and float32 LM head
(``cpu_dense_f32.c``) of two trees, A/B in one process: the library's
sources at git ref ``--old`` (default HEAD) and the working tree's, each
built with the library's flags into a temporary directory and loaded side
by side, then timed interleaved (old, new, old, ...) on the MoE tiny
model's layer (H 512, I 256, E 32, k 4, float32, random routing) at 16 rows
(a decode step of 16 requests) and 256 (a prefill chunk), and its LM head
(32768 x 512) at 16 and 64 rows (the same bits required): the median ms of
each and the ratio, the load average beside them.
``--threads`` the threads of each call (the library takes torch's count);
the medians of wall and of the process's CPU ms (every thread). Both must
give the same bits where ``--same-bits`` (a change that keeps the
kernel's sums), else they are compared to the torch reference.

    python3 benchmarks/studies/moe/moe_kernel_ab.py --old HEAD --repeats 30
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from asyncstep.ops.cpu import library as lib
from asyncstep.ops.cpu.dense_f32 import CpuDenseF32Matmul
from asyncstep.ops.cpu.moe import CpuMoeExperts
from asyncstep.ops.torch_moe import fused_experts

SIZE, INTER, EXPERTS, TOP_K, VOCAB = 512, 256, 32, 4, 32768
#: A layer's inputs: hidden, w13, w2, routing weights, ids.
Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def build(sources: Path, target: Path) -> tuple[CpuMoeExperts, CpuDenseF32Matmul]:
    """The library from ``sources`` (a folder holding its files) at
    ``target``: its experts and its float32 matmul."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or "cc"
    flags = [*lib.BASE_FLAGS, *lib._isa_flags(), *lib.FLAG_SETS[0]]
    files = [str(sources / p.name) for p in lib.SOURCES]
    subprocess.run([compiler, *flags, *files, "-o", str(target), *lib.LIBS], check=True)
    library = ctypes.CDLL(str(target))
    return CpuMoeExperts(library), CpuDenseF32Matmul(library)


def export(ref: str, into: Path) -> None:
    """The library's sources and headers at git ``ref`` into ``into``."""
    root = Path(__file__).resolve().parents[3]
    for path in (*lib.SOURCES, *lib.HEADERS):
        rel = path.relative_to(root)
        shown = subprocess.run(["git", "show", f"{ref}:{rel}"], cwd=root, capture_output=True)
        if shown.returncode == 0:  # (a header newer than ref: absent there)
            (into / path.name).write_bytes(shown.stdout)


def layer(tokens: int, seed: int) -> Layer:
    """A layer's inputs: hidden, w13, w2, routing weights, ids."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, SIZE, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, SIZE, generator=g) * 0.05
    w2 = torch.randn(EXPERTS, SIZE, INTER, generator=g) * 0.05
    scores = torch.softmax(torch.randn(tokens, EXPERTS, generator=g), dim=-1)
    weights, ids = torch.topk(scores, TOP_K, dim=-1)
    return hidden, w13, w2, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def time_pair(
    old: Callable[[], object], new: Callable[[], object], repeats: int
) -> dict[str, float]:
    """Interleaved medians (ms) over ``repeats`` calls each (a layer's
    experts, 48 MiB, outgrow the L3: the calls stream them as a step does)."""
    times: dict[str, list[float]] = {"old": [], "new": [], "old_cpu": [], "new_cpu": []}
    for _ in range(repeats):
        for name, fn in (("old", old), ("new", new)):
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
            times[f"{name}_cpu"].append(1e3 * (time.process_time() - cpu))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        **medians,
        "ratio_old_over_new": medians["old"] / medians["new"],
        "cpu_ratio_old_over_new": medians["old_cpu"] / medians["new_cpu"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="HEAD")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--same-bits", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        old_src = Path(tmp) / "old"
        old_src.mkdir()
        export(args.old, old_src)
        old, old_matmul = build(old_src, Path(tmp) / "old.so")
        new, new_matmul = build(lib.SOURCES[0].parent, Path(tmp) / "new.so")
        report: dict[str, object] = {"old": args.old, "threads": torch.get_num_threads()}
        for tokens in (16, 256):
            inputs = layer(tokens, seed=tokens)
            a, b = old(*inputs), new(*inputs)
            ref = fused_experts(*inputs)
            if args.same_bits:
                assert torch.equal(a, b), f"{tokens} rows: the builds' bits differ"
            error = float((b - ref).abs().max() / ref.abs().max())
            report[f"experts_rows_{tokens}"] = {
                **time_pair(partial(old, *inputs), partial(new, *inputs), args.repeats),
                "new_rel_error_vs_torch": error,
                "load_avg": os.getloadavg()[0],
            }
        head = torch.randn(VOCAB, SIZE, generator=torch.Generator().manual_seed(0))
        for tokens in (16, 64):
            x = torch.randn(tokens, SIZE, generator=torch.Generator().manual_seed(tokens))
            assert torch.equal(old_matmul(x, head), new_matmul(x, head)), "LM head bits differ"
            report[f"lm_head_rows_{tokens}"] = {
                **time_pair(
                    partial(old_matmul, x, head), partial(new_matmul, x, head), args.repeats
                ),
                "load_avg": os.getloadavg()[0],
            }
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
