"""The Triton fused mixture-of-experts (``asyncstep.ops.triton.fused_moe``,
issue 41) against a torch loop over the active experts and the floor.

For each model shape (qwen3-30b-a3b: H 2048, I 768, E 128, k 8, silu;
gpt-oss-20b: H 2880, I 2880, E 32, k 4, swigluoai with biases) and T in
TOKENS (or ``--tokens``), random routings (k distinct experts a token,
softmax weights): the median µs of ``fused_experts`` (its default: the path
``GEMV_MAX_PAIRS`` picks; then the grouped GEMM with each of ``--tiles``),
of the two paths captured in a CUDA graph (no launch overhead), of the
torch loop (per active expert: gather its tokens, two ``F.linear``, the
activation, the weight, ``index_add_``), and the floor: the active
experts' weight bytes over the copy bandwidth (a device-to-device copy's).
Each variant is checked against the torch loop first (relative error,
Frobenius). ``--layers`` copies of the weights rotate so the weights stream from HBM.

    python3 benchmarks/studies/moe/fused_moe_kernel.py [--out moe.json]
    python3 benchmarks/studies/moe/fused_moe_kernel.py --tiny   # CPU, interpreter

``--tiny``: a tiny shape, float32, on the CPU under the Triton interpreter
where there is no GPU (the script's own check; its times mean nothing).

The small-T path (issue 41): at each T the default tile's two paths in a
CUDA graph, ``grouped`` (``gemv_max_pairs=0``: the alignment and the
grouped GEMM) and ``small-T`` (every T through the GEMV kernels), and
``--gemv-tiles`` adds GEMV_TILES at T <= 32; after each shape a line names
the largest ``T * k`` where small-T is faster (the threshold to set as
``GEMV_MAX_PAIRS``). The routing: ``--routing`` times, per T, a layer's
routing and alignment in a CUDA graph, the torch ops (``select_experts`` and
``torch_align_block_size``) against the Triton kernels (``topk_route`` and
``moe_align_block_size``, forced at every T; and ``topk_route`` alone, all
the small-T path needs) at ``--routing-tokens``, each checked equal to the
torch ops' first.

    python3 benchmarks/studies/moe/fused_moe_kernel.py --routing --gemv-tiles --tokens 1 2 4 8 16 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout


@dataclass(frozen=True)
class MoeShape:
    """One model's experts."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    activation: str
    biases: bool


SHAPES = [
    MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, "silu", False),
    MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, "swigluoai", True),
]
TINY = [
    MoeShape("tiny", 96, 40, 8, 2, "silu", False),
    MoeShape("tiny-oss", 80, 48, 4, 2, "swigluoai", True),
]
TOKENS = [1, 2, 4, 8, 16, 32, 256]
TINY_TOKENS = [1, 5]
#: Every T through the small-T path (or the alignment kernels).
ALWAYS = 1 << 30
#: ``--routing``'s T: decode sizes, then prompts (the alignment kernels'
#: crossover with torch's sort, ALIGN_KERNEL_MAX_PAIRS).
ROUTING_TOKENS = [1, 8, 32, 128, 512, 2048, 8192]

#: Tiles tried beside the default: (block_m, block_n, block_k, warps, stages).
TILES = [
    (16, 32, 64, 4, 3),
    (16, 128, 64, 4, 3),
    (32, 64, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (64, 128, 64, 8, 3),
]

#: Small-T tiles tried beside the default: (block_n, block_k, warps, stages, down_block_n).
GEMV_TILES = [
    (2, 1024, 4, 3, 2),
    (4, 1024, 4, 3, 4),
    (4, 512, 4, 3, 8),
    (8, 512, 4, 3, 8),
    (8, 256, 2, 3, 8),
    (16, 256, 4, 3, 16),
]
#: The largest T the GEMV tiles are tried at.
GEMV_TILES_MAX_T = 32


HEADER = (
    f"{'shape':14s} {'T':>4s} {'active':>6s} {'floor us':>9s}  {'variant':28s} "
    f"{'us':>9s} {'x floor':>8s} {'rel err':>8s}"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiles", action="store_true", help="also time TILES")
    parser.add_argument("--gemv-tiles", action="store_true", help="also time GEMV_TILES")
    parser.add_argument(
        "--gemv-tile",
        action="append",
        metavar="N,K,WARPS,STAGES,DOWN_N",
        help="a GEMV tile to time instead of GEMV_TILES (repeatable; implies --gemv-tiles)",
    )
    parser.add_argument("--routing", action="store_true", help="also time the routing")
    parser.add_argument("--tokens", type=int, nargs="+", help="the T to run (default: TOKENS)")
    parser.add_argument(
        "--routing-tokens", type=int, nargs="+", help="--routing's T (default: ROUTING_TOKENS)"
    )
    parser.add_argument("--shapes", nargs="+", help="the shapes' names to run (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.tiny:
            parser.error("no GPU: only --tiny runs on the CPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import
    from asyncstep.ops.triton.fused_moe import TILE, MoeTile

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes, tokens = (TINY, TINY_TOKENS) if args.tiny else (SHAPES, TOKENS)
    shapes = [s for s in shapes if not args.shapes or s.name in args.shapes]
    tokens = args.tokens or tokens
    layers, iters = (1, 2) if args.tiny else (args.layers, args.iters)
    gemv_tiles = [tuple(int(v) for v in t.split(",")) for t in args.gemv_tile or []] or GEMV_TILES
    bandwidth = copy_bandwidth(device)
    # "triton default": the path GEMV_MAX_PAIRS picks, eager; the tiles: the grouped GEMM.
    variants: dict[str, Callable[..., torch.Tensor]] = {"triton default": triton_fn(TILE)}
    for tile in [MoeTile(*t) for t in TILES] if args.tiles else []:
        variants[f"grouped {tile_label(tile)}"] = triton_fn(tile, gemv_max_pairs=0)
    variants["torch loop"] = torch_loop
    graph = ", CUDA graph" if cuda else ""
    variants[GROUPED + graph] = triton_fn(TILE, gemv_max_pairs=0)
    variants[SMALL_T + graph] = triton_fn(TILE, gemv_max_pairs=ALWAYS)
    print(f"{device} {dtype}; copy bandwidth {bandwidth / 1e9:.0f} GB/s\n{HEADER}")
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        weights = [make_weights(shape, dtype, device, seed=i) for i in range(layers)]
        for t in tokens:
            case = Case(shape, *make_routing(shape, t, dtype, device), weights)
            sweep = args.gemv_tiles or args.gemv_tile
            extra = gemv_variants(graph, gemv_tiles) if sweep and t <= GEMV_TILES_MAX_T else {}
            for label, fn in (variants | extra).items():
                row = measure(case, label, fn, bandwidth, iters, cuda)
                rows.append(row)
                print(format_row(row), flush=True)
        print(threshold_line(shape, rows), flush=True)
    routing_tokens = args.routing_tokens or (TINY_TOKENS if args.tiny else ROUTING_TOKENS)
    routing = run_routing(shapes, routing_tokens, device, iters, cuda) if args.routing else []
    if args.out:
        name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
        kept = {"device": name, "dtype": str(dtype), "bandwidth": bandwidth, "rows": rows}
        args.out.write_text(json.dumps(kept | {"routing": routing}, indent=1))
    return 0


#: The two paths' labels (without ", CUDA graph").
GROUPED, SMALL_T = "grouped (default tile)", "small-T (default tile)"


def gemv_variants(
    graph: str, tiles: list[tuple[int, ...]]
) -> dict[str, Callable[..., torch.Tensor]]:
    """The small-T path with each of ``tiles`` (GemvTile's fields in order)."""
    from asyncstep.ops.triton.fused_moe import GemvTile

    return {
        f"small-T n{n}/{d} k{k} w{w} s{st}{graph}": triton_fn(
            None, gemv_max_pairs=ALWAYS, gemv_tile=GemvTile(n, k, w, st, d)
        )
        for n, k, w, st, d in tiles
    }


def threshold_line(shape: MoeShape, rows: list[dict[str, Any]]) -> str:
    """The largest ``T * k`` up to which the small-T path (default tile) was
    faster than the grouped GEMM at every T of ``shape``: the threshold."""
    us = {
        (r["tokens"], r["variant"].split(",")[0]): r["us"]
        for r in rows
        if r["shape"]["name"] == shape.name
    }
    best = 0
    for t in sorted({t for t, _ in us}):
        if us[(t, SMALL_T)] >= us[(t, GROUPED)]:
            break
        best = t * shape.top_k
    return f"{shape.name}: small-T faster up to T * k = {best} (GEMV_MAX_PAIRS)\n"


@dataclass
class Case:
    """One shape at one T: its routing and its layers' weights."""

    shape: MoeShape
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    weights: list[dict[str, Any]]

    def run(self, fn: Callable[..., torch.Tensor], w: dict[str, Any]) -> torch.Tensor:
        return fn(self.x, w, self.topk_weights, self.topk_ids, self.shape.activation)


def measure(
    case: Case,
    label: str,
    fn: Callable[..., torch.Tensor],
    bandwidth: float,
    iters: int,
    cuda: bool,
) -> dict[str, Any]:
    """One variant at one case: checked against the torch loop, then timed
    over the layers (µs a layer)."""
    want = case.run(torch_loop, case.weights[0]).float()
    got = case.run(fn, case.weights[0]).float()
    err = float((got - want).norm() / want.norm())

    def step() -> None:
        for w in case.weights:
            case.run(fn, w)

    timer = time_graph if label.endswith("CUDA graph") else time_us
    us = timer(step, iters, cuda) / len(case.weights)
    active = int(case.topk_ids.unique().numel())
    floor_us = active * expert_bytes(case.shape, case.x.dtype) / bandwidth * 1e6
    return {
        "shape": asdict(case.shape),
        "tokens": case.x.shape[0],
        "active_experts": active,
        "floor_us": floor_us,
        "variant": label,
        "us": us,
        "x_floor": us / floor_us,
        "max_rel_error": err,
    }


def format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['shape']['name']:14s} {row['tokens']:4d} {row['active_experts']:6d} "
        f"{row['floor_us']:9.1f}  {row['variant']:28s} {row['us']:9.1f} "
        f"{row['x_floor']:8.2f} {row['max_rel_error']:8.1e}"
    )


def tile_label(tile: Any) -> str:
    return f"m{tile.block_m} n{tile.block_n} k{tile.block_k} w{tile.num_warps} s{tile.num_stages}"


def make_weights(
    shape: MoeShape, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, Any]:
    """One layer's experts, scaled so activations stay near 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.inter

    def randn(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    return {
        "w13": randn(e, 2 * i, h, scale=h**-0.5),
        "w2": randn(e, h, i, scale=i**-0.5),
        "w13_bias": randn(e, 2 * i, scale=0.1) if shape.biases else None,
        "w2_bias": randn(e, h, scale=0.1) if shape.biases else None,
    }


def make_routing(
    shape: MoeShape, t: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, topk_weights (float32) and topk_ids (int32, k distinct experts a token)."""
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, shape.hidden, generator=gen).to(dtype).to(device)
    ids = torch.rand(t, shape.experts, generator=gen).argsort(dim=1)[:, : shape.top_k]
    weights = torch.randn(t, shape.top_k, generator=gen).softmax(dim=-1)
    return x, weights.to(device), ids.to(torch.int32).to(device)


def expert_bytes(shape: MoeShape, dtype: torch.dtype) -> int:
    """One expert's weights (and biases): what a step must read per active expert."""
    size = 3 * shape.hidden * shape.inter + (2 * shape.inter + shape.hidden) * shape.biases
    return size * torch.finfo(dtype).bits // 8


def triton_fn(tile: Any, **options: Any) -> Callable[..., torch.Tensor]:
    """fused_experts with ``tile`` (None: the default) and ``options``."""
    from asyncstep.ops.triton.fused_moe import TILE, fused_experts

    def run(
        x: torch.Tensor, w: dict[str, Any], tw: torch.Tensor, ti: torch.Tensor, act: str
    ) -> torch.Tensor:
        return fused_experts(
            x,
            w["w13"],
            w["w2"],
            tw,
            ti,
            act,
            w["w13_bias"],
            w["w2_bias"],
            tile=tile or TILE,
            **options,
        )

    return run


def activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """silu(gate) * up, or swigluoai, of gate rows then up rows."""
    from asyncstep.ops.triton.fused_moe import SWIGLU_ALPHA, SWIGLU_LIMIT

    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_ALPHA)


def torch_loop(
    x: torch.Tensor,
    w: dict[str, Any],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The per-expert loop (one host sync for the active experts)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // topk_ids.shape[1]
        b13 = None if w["w13_bias"] is None else w["w13_bias"][e]
        b2 = None if w["w2_bias"] is None else w["w2_bias"][e]
        act = activate(F.linear(x[tokens], w["w13"][e], b13), activation)
        y = F.linear(act, w["w2"][e], b2).float() * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def time_us(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Median µs of fn (after a warm-up call)."""
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_graph(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Median µs of a replay of fn captured in a CUDA graph (no launch
    overhead: how a decode step runs it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm up off the default stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_us(graph.replay, iters, cuda)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second of a device-to-device copy (read + write) of 1 GiB
    (16 MiB on the CPU)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), 3 if device.type == "cpu" else 10, device.type == "cuda")
    return 2 * n / (us * 1e-6)


def run_routing(
    shapes: list[MoeShape], tokens: list[int], device: torch.device, iters: int, cuda: bool
) -> list[dict[str, Any]]:
    """A layer's routing and alignment: the torch ops against the Triton
    kernels at each shape and T (µs, a CUDA graph's replay on the GPU),
    each checked equal to the torch ops first."""
    timer = time_graph if cuda else time_us
    print(f"{'shape':14s} {'T':>4s}  {'routing + alignment':32s} {'us':>9s} {'/ triton':>8s}")
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for t in tokens:
            gen = torch.Generator().manual_seed(t)
            dtype = torch.bfloat16 if cuda else torch.float32
            logits = torch.randn(t, shape.experts, generator=gen).to(dtype).to(device)
            cases = routing_cases(shape, logits)
            a, b = cases["torch ops"](), cases["triton"]()
            fields = ("sorted_ids", "expert_ids", "padded_pairs")
            same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)
            us = {label: timer(fn, iters, cuda) for label, fn in cases.items()}
            for label, value in us.items():
                ratio = value / us["triton"]
                print(f"{shape.name:14s} {t:4d}  {label:32s} {value:9.1f} {ratio:8.2f}", flush=True)
            rows.append({"shape": shape.name, "tokens": t, "us": us, "same_alignment": same})
            if not same:
                print(f"{shape.name} T={t}: the alignments DIFFER", flush=True)
    return rows


def routing_cases(shape: MoeShape, logits: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The shape's routing (gpt-oss: the top-k logits' softmax; qwen3:
    softmax, renormalised) and alignment, by torch ops and by the kernels,
    and the kernels' routing alone (all the small-T path needs)."""
    from asyncstep.ops.torch_moe import select_experts
    from asyncstep.ops.triton.fused_moe import TILE
    from asyncstep.ops.triton.moe_routing import (
        moe_align_block_size,
        topk_route,
        torch_align_block_size,
    )

    scoring = "topk_softmax" if shape.activation == "swigluoai" else "softmax"
    route = {"renormalize": shape.activation == "silu", "scoring_func": scoring}
    e, k, m = shape.experts, shape.top_k, TILE.block_m

    def old() -> Any:
        return torch_align_block_size(select_experts(logits, k, **route)[1], e, m)

    def new() -> Any:
        ids = topk_route(logits, k, **route)[1]
        return moe_align_block_size(ids, e, m, kernel_max_pairs=ALWAYS)

    def new_route() -> Any:
        return topk_route(logits, k, **route)

    return {"torch ops": old, "triton": new, "triton routing alone": new_route}


if __name__ == "__main__":
    raise SystemExit(main())
