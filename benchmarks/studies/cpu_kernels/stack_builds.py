"""The CPU library's decoder stack (``cpu_decode.c``: a step's layers in one
call) of two source trees on the same engine steps, in one process: an
in-process engine on the embedded model runs ``--num-prompts`` random
prompts (``--input-len`` tokens, ``--output-len`` greedy tokens each, as
``bench throughput`` does); every stack call is made twice on the same
inputs, once with tree A's library and once with tree B's (which first
alternates call by call), each timed, and B's outputs checked bit for bit
against A's (the call is idempotent: it writes the step's keys and values
to the same slots and returns new tensors). B's results go on. Figures per
step size (the decode steps of exactly ``--num-prompts`` rows, and the
prompt steps): the median of A's and B's times, the median of the steps'
B / A, and whether every B output equalled A's.

    python3 benchmarks/studies/cpu_kernels/stack_builds.py /tmp/before . \\
        --num-prompts 64 --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import trio

from asyncstep.ops.cpu import library

SOURCES = tuple(path.name for path in library.SOURCES)


def build(tree: Path, target: Path) -> Any:
    """The tree's ``asyncstep_decode_stack``, built with the library's flags."""
    sources = [str(tree / "asyncstep/ops/cpu" / name) for name in SOURCES]
    flags = [*library.BASE_FLAGS, *library.ISA_FLAGS["native"], "-fopenmp"]
    subprocess.run(["cc", *flags, *sources, "-o", str(target), *library.LIBS], check=True)
    fn = ctypes.CDLL(str(target)).asyncstep_decode_stack
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_int
    return fn


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("a", type=Path, help="source tree A (the baseline)")
    parser.add_argument("b", type=Path, help="source tree B")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--build-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    fns = {
        "a": build(args.a, args.build_dir / "stack_builds_a.so"),
        "b": build(args.b, args.build_dir / "stack_builds_b.so"),
    }

    from asyncstep.ops.cpu import decode_stack

    stack_call = decode_stack.CpuDecodeStack.__call__
    times: dict[int, dict[str, list[float]]] = defaultdict(lambda: {"a": [], "b": []})
    same = {"all": True}
    turn = {"n": 0}

    def both(self: Any, hidden: torch.Tensor, *rest: Any) -> Any:
        outs: dict[str, Any] = {}
        order = "ab" if turn["n"] % 2 == 0 else "ba"
        turn["n"] += 1
        for name in order:
            self._fn = fns[name]
            start = time.perf_counter()
            outs[name] = stack_call(self, hidden, *rest)
            times[hidden.shape[0]][name].append(time.perf_counter() - start)
        same["all"] &= all(torch.equal(x, y) for x, y in zip(outs["a"], outs["b"], strict=True))
        return outs["b"]

    decode_stack.CpuDecodeStack.__call__ = both  # type: ignore[method-assign,assignment]

    import asyncstep
    from asyncstep import SamplingParams
    from asyncstep.bench.workload import random_prompts

    async def run(n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        options = {
            "engine_process": False,
            "cpu_threads": args.threads,
            "max_num_seqs": n,
            "max_num_batched_tokens": 2048,
        }
        async with asyncstep.open_engine(**options) as engine:
            prompts = random_prompts(49152, [args.input_len] * n, 0)
            await engine.generate(prompts[0][:8], SamplingParams(max_tokens=2))  # warm up
            times.clear()
            async with trio.open_nursery() as nursery:
                for p in prompts:
                    nursery.start_soon(engine.generate, p, params)

    print(f"threads {args.threads}; A {args.a}, B {args.b}; medians over the steps")
    for n in args.num_prompts:
        trio.run(run, n)
        for rows in sorted(times):
            ta, tb = times[rows]["a"], times[rows]["b"]
            if rows != n and rows <= 2 * n:
                continue  # the ramp's odd sizes
            ratio = statistics.median(y / x for x, y in zip(ta, tb, strict=True))
            print(
                f"{n:3d} prompts, steps of {rows:5d} rows ({len(ta):3d}): "
                f"A {1e3 * statistics.median(ta):8.2f} ms  B {1e3 * statistics.median(tb):8.2f} ms"
                f"  B/A {ratio:5.3f}",
                flush=True,
            )
    print(f"B's outputs equal A's: {same['all']}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("ASYNCSTEP_LOG_LEVEL", "warning")
    sys.exit(main())
