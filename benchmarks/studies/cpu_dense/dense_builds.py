"""The dense matmul's builds (``cpu_dense.c`` compiled for AVX2, AVX512F and
AVX512-BF16) against torch's bf16 ``F.linear`` under the same ISA: for
each build, a subprocess whose torch is held to that ISA
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``: "AVX2" is what a CPU with
AVX2 + FMA + F16C only, CI's, runs; there torch's bf16 matmul leaves oneDNN
for ATen's own loops) times torch and ours interleaved, on the embedded
SmolLM2-135M's projections (qkv 576 -> 960, o 576 -> 576, gate_up 576 ->
3072, down 1536 -> 576, LM head 576 -> 49152 up to 256 rows: a step's
logits are one row per sequence). Ours takes bf16 x and writes bf16 (the
layers' call). A figure is the best call of ``--rounds`` x ``--repeats``;
read the ratios (torch / ours: above 1, ours faster). ``--ref REV`` also
times ``cpu_dense.c`` as of a git revision (the same ISA's build; printed,
as ``torch_f32``, as its time / ours).
``--step``: instead, a decode step's 120 projections (30 layers' qkv, o,
gate_up, down: 212 MB of distinct weights, streamed from DRAM as in a
model's step) at ``--rows`` rows (default 1, 2, 4, 8, 16). ``--torch-native``
leaves torch unheld (this CPU's own bf16 path, AVX512-BF16 here: what the
AVX2 build would be measured against on a newer CPU); ``--f32`` also times
torch's float32 ``F.linear`` of a float32 copy of W (``torch_f32``: on an
AVX2 CPU the FMA peak our widened-bf16 products share, and the dtype an
AVX2-only CPU defaults to).

    python3 benchmarks/studies/cpu_dense/dense_builds.py \\
        --out benchmarks/results/cpu/dense_avx2_1205/builds.json
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import asyncstep
from asyncstep.ops.cpu.dense import CpuDenseMatmul

#: The build's compiler flags and the environment that holds torch to its ISA.
BUILDS = {
    "AVX2": (
        ["-mavx2", "-mfma", "-mf16c"],
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    ),
    "AVX512F": (
        ["-march=native", "-mno-avx512bf16"],
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
    ),
    "AVX512-BF16": (["-march=native"], {}),
}
SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
ROWS = (1, 4, 16, 64, 256, 2048)
#: --step's rows (a decode step's batch).
STEP_ROWS = (1, 2, 4, 8, 16)
#: Rows the LM head runs at most (one per sequence of a step).
HEAD_ROWS = 256
SOURCE = Path(asyncstep.__file__).parent / "ops/cpu/cpu_dense.c"


def build(isa: str, source: str, tag: str) -> CpuDenseMatmul:
    """``source`` (cpu_dense.c's text) built for ``isa`` with OpenMP, cached in /tmp."""
    flags = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", *BUILDS[isa][0]]
    key = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"dense_{tag}_{key}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "cpu_dense.c"
            src.write_text(source)
            (Path(tmp) / "cpu_common.h").write_text((SOURCE.parent / "cpu_common.h").read_text())
            built = Path(tmp) / target.name
            subprocess.run(["cc", *flags, str(src), "-o", str(built)], check=True)
            os.replace(built, target)
    matmul = CpuDenseMatmul(ctypes.CDLL(str(target)))
    assert matmul.isa == isa, (matmul.isa, isa)
    return matmul


def best_us(call: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def worker(args: argparse.Namespace) -> None:
    """One build's figures, as JSON lines on stdout (run under its ISA's environment)."""
    torch.set_num_threads(args.threads)
    variants: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
        "torch": lambda x, w: torch.nn.functional.linear(x, w)
    }
    ours = build(args.worker, SOURCE.read_text(), "ours")
    variants["ours"] = lambda x, w: ours(x, w, torch.bfloat16)
    if args.f32:
        # W and its float32 copy, made once per weight (W kept: its id not reused)
        floats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def f32(x: torch.Tensor, w: torch.Tensor) -> object:
            if id(w) not in floats:
                floats[id(w)] = (w, w.float())
            return torch.nn.functional.linear(x.float(), floats[id(w)][1])

        variants["torch_f32"] = f32
    if args.ref:
        text = subprocess.run(
            ["git", "show", f"{args.ref}:asyncstep/ops/cpu/cpu_dense.c"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        ref = build(args.worker, text, "ref")
        variants["ref"] = lambda x, w: ref(x, w, torch.bfloat16)
    if args.step:
        step(args, variants)
        return
    for name in args.shapes:
        k, n = SHAPES[name]
        weight = (torch.randn(n, k) * 0.05).bfloat16()
        for rows in args.rows:
            if name == "lm_head" and rows > HEAD_ROWS:
                continue
            x = torch.randn(rows, k).bfloat16()
            for call in variants.values():  # warm
                call(x, weight)
            best = {v: float("inf") for v in variants}
            for _ in range(args.rounds):
                for v, call in variants.items():
                    timed = best_us(lambda c=call, x=x, w=weight: c(x, w), args.repeats)
                    best[v] = min(best[v], timed)
            line = {
                "isa": args.worker,
                "torch_capability": torch.backends.cpu.get_cpu_capability(),
                "shape": name,
                "k": k,
                "n": n,
                "rows": rows,
                "threads": args.threads,
                **{f"{v}_us": round(t, 1) for v, t in best.items()},
            }
            print(json.dumps(line), flush=True)


def step(
    args: argparse.Namespace, variants: dict[str, Callable[[torch.Tensor, torch.Tensor], object]]
) -> None:
    """A decode step's projections, each weight its own (the step's weights
    do not fit a cache), as JSON lines."""
    layer = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]
    weights = [(torch.randn(n, k) * 0.05).bfloat16() for _ in range(30) for k, n in layer]
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for k, _ in layer}

        def run(
            call: Callable[[torch.Tensor, torch.Tensor], object], xs: dict[int, torch.Tensor] = xs
        ) -> None:
            for w in weights:
                call(xs[w.shape[1]], w)

        best = {v: float("inf") for v in variants}
        for _ in range(args.rounds):
            for v, call in variants.items():
                best[v] = min(best[v], best_us(lambda c=call: run(c), args.repeats))
        line = {
            "isa": args.worker,
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "shape": "step",
            "rows": rows,
            "threads": args.threads,
            **{f"{v}_us": round(t, 1) for v, t in best.items()},
        }
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ref", help="also time cpu_dense.c as of this git revision")
    parser.add_argument("--step", action="store_true", help="a decode step's projections")
    parser.add_argument("--out", type=Path, help="JSON lines here too")
    parser.add_argument(
        "--torch-native", action="store_true", help="torch not held to the build's ISA"
    )
    parser.add_argument("--f32", action="store_true", help="also torch's float32 F.linear")
    parser.add_argument("--worker", choices=list(BUILDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows is None:
        args.rows = list(STEP_ROWS if args.step else ROWS)
    if args.worker:
        worker(args)
        return
    results = []
    for isa in args.isa:
        command = [sys.executable, __file__, "--worker", isa, "--threads", str(args.threads)]
        command += ["--rounds", str(args.rounds), "--repeats", str(args.repeats)]
        command += ["--shapes", *args.shapes, "--rows", *map(str, args.rows)]
        command += ["--ref", args.ref] if args.ref else []
        command += ["--step"] if args.step else []
        command += ["--f32"] if args.f32 else []
        env = {**os.environ, **({} if args.torch_native else BUILDS[isa][1])}
        run = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True)
        for text in run.stdout.splitlines():
            r = json.loads(text)
            results.append(r)
            shown = f"{r['isa']:>11} ({r['torch_capability']}) {r['shape']:>7} rows {r['rows']:4d}"
            shown += f": torch {r['torch_us']:10.1f} us  ours {r['ours_us']:9.1f} us"
            shown += f" ({r['torch_us'] / r['ours_us']:5.2f}x)"
            for v in ("ref", "torch_f32"):
                if f"{v}_us" in r:
                    us = r[f"{v}_us"]
                    shown += f"  {v} {us:9.1f} us ({us / r['ours_us']:5.2f}x)"
            print(shown, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
