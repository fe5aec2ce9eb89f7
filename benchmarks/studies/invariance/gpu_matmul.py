"""The batch-invariant matmul at decode sizes (issue 40), on llama-8b's
(or ``--model llama-1b``'s) linear shapes. First the bit check: row 0 of
every M, by each launch, against M = 1's (exit status 1 if any differ).
Then at M = 1, 8, 32, 256 (and 2048, a prefill chunk) the invariant matmul
(the launch chosen, the other one where both run, and unsplit: the kernel
before the split) against ``F.linear`` (cuBLAS), the one-row GEMV of the
fast path (M = 1) and the HBM floor (the weight, x and the output once, at
the bandwidth a device-to-device copy reaches). Then a sweep of the split's
constants (TARGET_PROGRAMS, the split programs' stages) at M = 1 and 32.

Each time is one matmul's share of a CUDA graph that runs it over enough
copies of the weight (>= 512 MiB in all) that none stays in L2, as a
decode step's layers read theirs: the median of 5 replays' averages.

    python3 benchmarks/studies/invariance/gpu_matmul.py
    python3 benchmarks/studies/invariance/gpu_matmul.py --model llama-1b --no-sweep
    python3 benchmarks/studies/invariance/gpu_matmul.py --device cpu --tiny  # a dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
import torch.nn.functional as F

from asyncstep.ops.triton import invariant_matmul as inv
from asyncstep.ops.triton.gemv import dense_gemv

#: (name, N, K) of each model's linear layers.
MODELS = {
    "llama-8b": [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("lm_head", 128256, 4096),
    ],
    "llama-1b": [
        ("qkv", 3072, 2048),
        ("o", 2048, 2048),
        ("gate_up", 16384, 2048),
        ("down", 2048, 8192),
        ("lm_head", 128256, 2048),
    ],
}
TINY_LINEARS = [("a", 96, 64), ("b", 80, 600)]
ROWS = (1, 8, 32, 256, 2048)
TINY_ROWS = (1, 8, 70)
#: The weight copies a timed graph reads, in all (more than any L2).
COPIES_BYTES = 512 << 20


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second of a 2 GiB device-to-device copy (read + write)."""
    if device.type != "cuda":
        return 1e12
    src = torch.empty(1 << 30, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 5 * 2 * src.numel() * 2 / (start.elapsed_time(end) / 1e3)


def timed(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Milliseconds of one of the ``calls`` matmuls ``fn`` runs: in a CUDA
    graph, the median of 5 replays' averages (once, eagerly, off CUDA)."""
    fn()
    if device.type != "cuda":
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3 / calls
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 3 / calls)
    return statistics.median(samples)


def weight_copies(
    n: int, k: int, dtype: torch.dtype, device: torch.device, tiny: bool
) -> list[torch.Tensor]:
    count = 2 if tiny else max(1, -(-COPIES_BYTES // (n * k * 2)))
    return [torch.randn(n, k, device=device).to(dtype) for _ in range(count)]


def over_copies(
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    ws: list[torch.Tensor],
) -> Callable[[], None]:
    def run() -> None:
        for w in ws:
            mm(x, w)

    return run


def unsplit(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """The invariant matmul with K in one split (the kernel before the split)."""
    saved = inv.TARGET_PROGRAMS
    inv.TARGET_PROGRAMS = 1
    try:
        return inv.invariant_matmul(x, w, out_dtype)
    finally:
        inv.TARGET_PROGRAMS = saved


def table(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bw: float) -> None:
    for name, n, k in TINY_LINEARS if args.tiny else MODELS[args.model]:
        ws = weight_copies(n, k, dtype, device, args.tiny)
        out_dtype = torch.float32 if name == "lm_head" else None
        for m in TINY_ROWS if args.tiny else ROWS:
            x = torch.randn(m, k, device=device).to(dtype)
            fast = timed(over_copies(F.linear, x, ws), device, len(ws))
            ours = timed(
                over_copies(functools.partial(inv.invariant_matmul, out_dtype=out_dtype), x, ws),
                device,
                len(ws),
            )
            old = timed(
                over_copies(functools.partial(unsplit, out_dtype=out_dtype), x, ws), device, len(ws)
            )
            gemv = ""
            if m == 1 and dtype != torch.float32:
                g = timed(over_copies(dense_gemv, x, ws), device, len(ws))
                gemv = f" gemv {g:7.4f}"
            out_bytes = 4 if out_dtype else 2
            floor = (n * k * 2 + m * k * 2 + m * n * out_bytes) / bw * 1e3
            splits = -(-k // inv.split_k(n, k))
            parallel = inv.launch_is_parallel(m, n, k, device)
            launch = "split programs" if parallel else "per tile"
            tiles = -(-m // inv.TILE.block_m) * -(-n // inv.TILE.block_n)
            other = ""  # the launch not chosen, where both can run
            if splits > 1 and tiles <= inv._max_parallel_tiles(device):
                forced = functools.partial(
                    inv.invariant_matmul, out_dtype=out_dtype, parallel=not parallel
                )
                other = f", other launch {timed(over_copies(forced, x, ws), device, len(ws)):7.4f}"
            print(
                f"{name:8} N={n:6} K={k:5} M={m:4}: F.linear {fast:7.4f}{gemv} | invariant "
                f"{ours:7.4f} ({splits} splits, {launch}{other}) unsplit {old:7.4f} | floor "
                f"{floor:7.4f} ms | invariant/F.linear x{ours / fast:5.2f}, "
                f"/floor x{ours / floor:5.2f}, unsplit/floor x{old / floor:5.2f}",
                flush=True,
            )


def sweep(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bw: float) -> None:
    """The split's constants at M = 1 and 32 (the bits change with
    TARGET_PROGRAMS, never with the stages)."""
    saved = (inv.TARGET_PROGRAMS, inv.TILE)
    for name, n, k in TINY_LINEARS if args.tiny else MODELS[args.model][:4]:
        ws = weight_copies(n, k, dtype, device, args.tiny)
        floor = n * k * 2 / bw * 1e3
        for m in (1, 32):
            x = torch.randn(m, k, device=device).to(dtype)
            cells = []
            for target in (256, 512, 1024):
                for stages in (3, 4, 5):
                    inv.TARGET_PROGRAMS = target
                    inv.TILE = dataclasses.replace(saved[1], split_stages=stages)
                    try:
                        t = timed(over_copies(inv.invariant_matmul, x, ws), device, len(ws))
                    finally:
                        inv.TARGET_PROGRAMS, inv.TILE = saved
                    cells.append(f"{target}/{stages}: x{t / floor:4.2f}")
            print(f"sweep {name:8} M={m:3} (target/stages: time/floor) " + " ".join(cells))


#: (BLOCK_N, BLOCK_K, warps) the tile sweep tries (BLOCK_M stays 64: one
#: warpgroup's MMA), each with TARGET_PROGRAMS x split stages.
SWEEP_TILES = [(bn, bk, w) for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8)]
SWEEP_SPLITS = [(t, s) for t in (128, 256, 512) for s in (3, 4, 5)]


def tile_sweep(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bw: float
) -> bool:
    """Per layer shape, every tile of :data:`SWEEP_TILES` x :data:`SWEEP_SPLITS`
    at M = 1 (split programs); the 12 best also at M = 32, and at M = 2048
    (a program per tile, 3 and 4 stages) against F.linear; each of those
    checked for row 0's bits at M = 1 (split) against M = 2048 (per tile).
    The tile may be any function of (N, K): the bits never depend on M."""
    saved = (inv.TARGET_PROGRAMS, inv.TILE)
    same = True

    def config(bn: int, bk: int, w: int, target: int, stages: int, big_stages: int = 3) -> None:
        inv.TARGET_PROGRAMS = target
        inv.TILE = inv.MatmulTile(64, bn, bk, w, big_stages, stages)

    for name, n, k in TINY_LINEARS if args.tiny else MODELS[args.model][:4]:
        ws = weight_copies(n, k, dtype, device, args.tiny)
        big = 70 if args.tiny else 2048
        xs = {m: torch.randn(m, k, device=device).to(dtype) for m in (1, 32, big)}
        floor = {m: (n * k * 2 + m * (k + n) * 2) / bw * 1e3 for m in xs}
        fast_big = timed(over_copies(F.linear, xs[big], ws), device, len(ws))
        ones = []
        try:
            for bn, bk, w in SWEEP_TILES:
                for target, stages in SWEEP_SPLITS:
                    config(bn, bk, w, target, stages)
                    try:
                        t = timed(over_copies(inv.invariant_matmul, xs[1], ws), device, len(ws))
                    except Exception as error:  # shared memory past the SM's, for one
                        print(f"  bn {bn} bk {bk} w {w} {target}/{stages}: {type(error).__name__}")
                        continue
                    ones.append((t / floor[1], bn, bk, w, target, stages))
            ones.sort()
            print(f"tiles {name:8} N={n} K={k}: M=1/floor, M=32/floor, M={big}/F.linear (3|4 st)")
            for r1, bn, bk, w, target, stages in ones[:12]:
                config(bn, bk, w, target, stages)
                t32 = timed(over_copies(inv.invariant_matmul, xs[32], ws), device, len(ws))
                alone = inv.invariant_matmul(xs[big][:1], ws[0])[0]
                cells = []
                for big_stages in (3, 4):
                    config(bn, bk, w, target, stages, big_stages)
                    mm = functools.partial(inv.invariant_matmul, parallel=False)
                    try:
                        t = timed(over_copies(mm, xs[big], ws), device, len(ws))
                    except Exception:  # shared memory past the SM's
                        t = float("inf")
                    cells.append(t / fast_big)
                config(bn, bk, w, target, stages)
                row = inv.invariant_matmul(xs[big], ws[0], parallel=False)[0]
                bits = "same" if torch.equal(row, alone) else "DIFFER"
                same = same and bits == "same"
                print(
                    f"  bn {bn:3} bk {bk:3} w {w} target {target:3} st {stages}: x{r1:5.2f} "
                    f"x{t32 / floor[32]:5.2f} | x{cells[0]:5.2f} x{cells[1]:5.2f} bits {bits}",
                    flush=True,
                )
        finally:
            inv.TARGET_PROGRAMS, inv.TILE = saved
    return same


#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, TMA) of :func:`prompt_tile_sweep`
#: (TMA: TMA loads and persistent programs; else the pointer kernel).
PROMPT_TILES = [
    (128, 128, 128, 8, 3, False),
    (128, 128, 128, 8, 3, True),
    (128, 128, 64, 8, 4, True),
    (128, 128, 64, 8, 5, True),
    (128, 256, 64, 8, 3, True),
    (128, 256, 64, 8, 4, True),
    (256, 128, 64, 8, 3, True),
]
PROMPT_ROWS = (128, 256, 512, 2048)


def prompt_tile_sweep(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> bool:
    """Per layer shape and M of :data:`PROMPT_ROWS`, every tile of
    :data:`PROMPT_TILES` as the prompt tile of every M (a program per tile) against
    TILE's launch and F.linear; each checked for its bits: the whole
    product the same as TILE's at that M, and row 0 the same as M = 1's
    (split programs). True if every tile kept the bits."""
    saved = (inv.PROMPT_TILES, inv._PROMPT_TMA)
    same = True
    rows = TINY_ROWS if args.tiny else PROMPT_ROWS
    try:
        for name, n, k in TINY_LINEARS if args.tiny else MODELS[args.model][:4]:
            ws = weight_copies(n, k, dtype, device, args.tiny)
            xs = {m: torch.randn(m, k, device=device).to(dtype) for m in rows}
            inv.PROMPT_TILES = ()
            alone = {m: inv.invariant_matmul(xs[m][:1], ws[0])[0] for m in rows}
            fast = {m: timed(over_copies(F.linear, xs[m], ws), device, len(ws)) for m in rows}
            base = {}
            for m in rows:
                mm = functools.partial(inv.invariant_matmul, parallel=None)
                base[m] = timed(over_copies(mm, xs[m], ws), device, len(ws))
            print(
                f"prompt tiles {name:8} N={n} K={k}: time / F.linear at M = "
                + ", ".join(map(str, rows))
                + "; TILE's launch: "
                + " ".join(f"x{base[m] / fast[m]:5.2f}" for m in rows)
                + " (F.linear "
                + " ".join(f"{fast[m] * 1e3:.0f}" for m in rows)
                + " us)",
                flush=True,
            )
            for bm, bn, bk, w, stages, tma in PROMPT_TILES:
                inv._PROMPT_TMA = tma
                inv.PROMPT_TILES = ()
                want = {m: inv.invariant_matmul(xs[m], ws[0], parallel=False) for m in rows}
                inv.PROMPT_TILES = ((1, inv.MatmulTile(bm, bn, bk, w, stages, stages)),)
                cells, bits = [], "same"
                for m in rows:
                    mm = functools.partial(inv.invariant_matmul, parallel=False)
                    try:
                        cells.append(timed(over_copies(mm, xs[m], ws), device, len(ws)) / fast[m])
                        got = mm(xs[m], ws[0])
                    except Exception as error:  # shared memory past the SM's
                        cells.append(float("inf"))
                        bits = f"{type(error).__name__}: {str(error).strip()[:160]}"
                        continue
                    if not (torch.equal(got, want[m]) and torch.equal(got[0], alone[m])):
                        bits = "DIFFER"
                same = same and (bits == "same" or bits.startswith("OutOfResources"))
                print(
                    f"  bm {bm:3} bn {bn:3} bk {bk:3} w {w} st {stages}"
                    f" {'TMA     ' if tma else 'pointers'}: "
                    + " ".join(f"x{c:5.2f}" for c in cells)
                    + f" bits {bits}",
                    flush=True,
                )
    finally:
        inv.PROMPT_TILES, inv._PROMPT_TMA = saved
    return same


def bit_check(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> bool:
    """Row 0 of every M, by each launch, against M = 1's: True if all the same bits."""
    same = True
    for name, n, k in TINY_LINEARS if args.tiny else MODELS[args.model]:
        w = torch.randn(n, k, device=device).to(dtype)
        out_dtype = torch.float32 if name == "lm_head" else None
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(2048 if not args.tiny else 70, k, device=device, generator=gen).to(dtype)
        alone = inv.invariant_matmul(x[:1], w, out_dtype)
        bad = []
        for m in (*(TINY_ROWS if args.tiny else ROWS), 3, 64, 65, 129):
            tiles = -(-m // inv.TILE.block_m) * -(-n // inv.TILE.block_n)
            launches: list[bool | None] = [None, False]
            if tiles <= inv._max_parallel_tiles(device):
                launches.append(True)
            for parallel in launches:
                row = inv.invariant_matmul(x[:m], w, out_dtype, parallel=parallel)[0]
                if not torch.equal(row, alone[0]):
                    bad.append(f"M={m} parallel={parallel}")
        print(
            f"bits {name:8}: " + ("row 0 the same at every M" if not bad else "DIFFER " + str(bad))
        )
        same = same and not bad
    return same


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run)")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-8b")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument(
        "--tile-sweep", action="store_true", help="only the tile sweep (tile_sweep's docstring)"
    )
    parser.add_argument(
        "--prompt-tile-sweep",
        action="store_true",
        help="only the prompt tiles (prompt_tile_sweep's docstring)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, "float16" if device.type == "cpu" else args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = copy_bandwidth(device)
    print(
        f"model={args.model} device={name} dtype={dtype} copy bandwidth {bw / 1e12:.2f} TB/s",
        flush=True,
    )
    if args.tile_sweep:
        sys.exit(0 if tile_sweep(args, device, dtype, bw) else 1)
    if args.prompt_tile_sweep:
        sys.exit(0 if prompt_tile_sweep(args, device, dtype) else 1)
    ok = bit_check(args, device, dtype)
    table(args, device, dtype, bw)
    if not args.no_sweep:
        sweep(args, device, dtype, bw)
    sys.exit(0 if ok else 1)
