"""One token's packed matmuls of SmolLM2 (30 layers of int4 weights of its
shapes, distinct so they stream from memory, and the int8 LM head) with the
CPU's torch threads, as a CPU rank runs them: on the main thread, and on a
second thread with and without an OpenMP pool left on the main thread (each
thread that ran a multi-threaded op keeps one; libgomp stops spinning between
parallel regions once it manages more threads than cores). Each case runs in
a fresh process.

    python3 benchmarks/studies/cpu_kernels/cpu_thread_pools.py \\
        --out benchmarks/results/cpu/cpu_thread_pools.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

CASES = {
    "one thread": "1 thread, main thread",
    "main": "all threads, main thread",
    "second thread": "all threads, a second thread, no other pool",
    "second thread + pool": "all threads, a second thread, the main thread's pool alive",
}
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def run_case(case: str, tokens: int) -> float:
    import torch

    from asyncstep.ops.packed import pack_int4, pack_int8_rows

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores if case == "second thread + pool" else 1)  # packing: no pool
    gen = torch.Generator().manual_seed(0)

    def q4(out: int, inp: int) -> torch.Tensor:
        codes = torch.randint(0, 16, (out, inp // 32, 32), generator=gen)
        codes[..., 0], codes[..., 1] = 0, 15  # as llama.cpp's quantizer pins the grid
        scale = torch.rand(out, inp // 32, 1, generator=gen) * 0.01
        zero = torch.randn(out, inp // 32, 1, generator=gen) * 0.01
        return ((codes - 8) * scale + zero).reshape(out, inp).float()

    layers = [
        {k: pack_int4(q4(*s), torch.bfloat16, 8) for k, s in SHAPES.items()} for _ in range(30)
    ]
    head = pack_int8_rows(torch.randn(49152, 576, generator=gen), torch.bfloat16, 8)
    x = torch.randn(1, 576, dtype=torch.bfloat16, generator=gen)
    x_down = torch.randn(1, 1536, dtype=torch.bfloat16, generator=gen)

    def token() -> None:
        for layer in layers:
            for name, w in layer.items():
                assert w is not None
                w.mm(x_down if name == "down" else x)
        head.mm(x)

    def timed() -> float:
        torch.set_num_threads(1 if case == "one thread" else cores)
        for _ in range(3):
            token()
        t0 = time.perf_counter()
        for _ in range(tokens):
            token()
        return (time.perf_counter() - t0) / tokens * 1e3

    if case in ("one thread", "main"):
        return timed()
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(timed()))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="each case this often, interleaved")
    ap.add_argument("--out")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(run_case(args.case, args.tokens))
        return
    ms: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            cmd = [sys.executable, __file__, "--case", case, "--tokens", str(args.tokens)]
            done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            ms[case].append(float(done.stdout.split()[-1]))
    for case, what in CASES.items():
        print(f"{what:60s} {min(ms[case]):6.2f} ms a token (best of {args.rounds})")
    print(f"load average after: {os.getloadavg()}")
    if args.out:
        record = {
            "command": "python3 " + " ".join(sys.argv),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "cores": len(os.sched_getaffinity(0)),
            "ms_per_token": ms,
            "load_average_after": os.getloadavg(),
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
