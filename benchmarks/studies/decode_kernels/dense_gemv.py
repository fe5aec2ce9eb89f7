"""The one-row GEMV of dense bf16 weights (``asyncstep.ops.triton.gemv``)
against cuBLAS (issue 28): the product alone, then a decoder layer's linear
part both ways.

1. For a model shape's four linear layers (qkv, o, gate_up, down),
   ``--layers`` distinct layers in one CUDA graph (the weights stream from
   HBM), median of ``--replays`` replays, µs a layer: ``F.linear`` (cuBLAS),
   the default launch (``auto``) and several others, each checked against
   ``F.linear`` first.
2. A layer's linear part (the attention left out, its output a fixed
   tensor): cuBLAS with the unfused kernels (add + RMSNorm, qkv, o, add +
   RMSNorm, gate_up, SiLU·mul, down: seven kernels), and the same with the
   Triton GEMV.

    python3 benchmarks/studies/decode_kernels/dense_gemv.py [--shape llama-8b] [--out results.json]

``--sweep NAME=N,K ...``: instead, each given weight shape alone against
every launch of :data:`SWEEP` that divides it (and the default), µs a
weight, ``--layers`` distinct weights in one CUDA graph.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

from quant_gpu import copy_bandwidth, layer_shapes, time_graph

from asyncstep.ops.triton.gemv import GemvLaunch, dense_gemv

#: Launches tried beside the default: (rows a program, features a step, warps).
LAUNCHES = [
    GemvLaunch(*launch)
    for launch in [
        (4, 256, 2),
        (4, 512, 4),
        (8, 256, 2),
        (8, 256, 4),
        (8, 512, 4),
        (16, 256, 4),
        (2, 512, 2),
        (2, 1024, 4),
        (4, 1024, 4),
    ]
]


#: Launches of ``--sweep``: (rows a program, features a step, warps).
SWEEP = [
    GemvLaunch(*launch)
    for launch in [
        (1, 1024, 2),
        (1, 2048, 4),
        (2, 512, 2),
        (2, 1024, 2),
        (2, 1024, 4),
        (2, 2048, 4),
        (4, 256, 2),
        (4, 512, 2),
        (4, 512, 4),
        (4, 1024, 4),
        (4, 1024, 8),
        (8, 256, 2),
        (8, 512, 4),
        (8, 1024, 8),
        (16, 256, 4),
        (16, 512, 8),
    ]
]


def sweep(named: list[str], layers: int, replays: int, device: torch.device) -> list[dict]:
    """µs a weight of each ``NAME=N,K`` shape by launch (see the module doc)."""
    bandwidth = copy_bandwidth(device)
    rows = []
    for spec in named:
        name, dims = spec.split("=")
        n, k = (int(v) for v in dims.split(","))
        ws = [(torch.randn(n, k, device=device) * 0.02).bfloat16() for _ in range(layers)]
        x = torch.randn(1, k, device=device).bfloat16()
        want = F.linear(x, ws[0]).float()
        floor = n * k * 2 / bandwidth * 1e6
        times: dict[str, float] = {}
        for launch in [None, *SWEEP]:
            if launch is not None and (n % launch.block_n or k % launch.block_k):
                continue
            label = (
                "auto"
                if launch is None
                else f"n{launch.block_n} k{launch.block_k} w{launch.num_warps}"
            )
            got = dense_gemv(x, ws[0], launch).float()
            if not float((got - want).norm() / want.norm()) < 1e-2:
                print(f"{name} {label}: WRONG", flush=True)
                continue

            def run(
                c: GemvLaunch | None = launch, x: torch.Tensor = x, ws: list[torch.Tensor] = ws
            ) -> None:
                for w in ws:
                    dense_gemv(x, w, c)

            times[label] = time_graph(run, replays) / layers * 1e6
        best = min(times, key=times.__getitem__)
        shown = " ".join(f"[{k}] {v:.2f}" for k, v in sorted(times.items(), key=lambda kv: kv[1]))
        print(
            f"{name} ({n}x{k}) floor {floor:.2f} us: auto {times['auto']:.2f}, best {best} "
            f"{times[best]:.2f} | {shown}",
            flush=True,
        )
        rows.append({"name": name, "n": n, "k": k, "floor_us": floor, "us": times})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", nargs="*", metavar="NAME=N,K")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.sweep:
        rows = sweep(args.sweep, args.layers, args.replays, device)
        if args.out:
            args.out.write_text(json.dumps({"sweep": rows}))
        return 0
    shapes = layer_shapes(args.shape)
    bandwidth = copy_bandwidth(device)
    weights = [
        {
            name: (torch.randn(n, k, device=device) * 0.02).bfloat16()
            for name, (n, k) in shapes.items()
        }
        for _ in range(args.layers)
    ]
    xs = {name: torch.randn(1, k, device=device).bfloat16() for name, (_, k) in shapes.items()}
    floors = {name: n * k * 2 / bandwidth * 1e6 for name, (n, k) in shapes.items()}
    print(f"{args.shape}: copy bandwidth {bandwidth / 1e12:.3f} TB/s; floors (us) {floors}")
    results: list[dict[str, Any]] = []

    def variant(label: str, product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        per_shape = {}
        for name in shapes:
            w0 = weights[0][name]
            want = F.linear(xs[name], w0).float()
            error = float((product(xs[name], w0).float() - want).norm() / want.norm())
            if not error < 1e-2:
                print(f"{label:28s} {name}: WRONG (rel error {error:.1e})", flush=True)
                return

            def run(name: str = name) -> None:
                for layer in weights:
                    product(xs[name], layer[name])

            per_shape[name] = time_graph(run, args.replays) / args.layers * 1e6
        total = sum(per_shape.values())
        results.append({"launch": label, "us_per_shape": per_shape, "us_per_layer": total})
        shown = " ".join(f"{k} {v:6.1f}" for k, v in per_shape.items())
        print(f"{label:28s} {total:7.1f} us/layer | {shown}", flush=True)

    variant("F.linear (cuBLAS)", lambda x, w: F.linear(x, w))
    variant("auto (the default launch)", lambda x, w: dense_gemv(x, w))
    for launch in LAUNCHES:
        fits = all(n % launch.block_n == 0 and k % launch.block_k == 0 for n, k in shapes.values())
        if fits:
            label = f"n{launch.block_n} k{launch.block_k} w{launch.num_warps}"
            variant(label, lambda x, w, c=launch: dense_gemv(x, w, c))
    variant("F.linear (cuBLAS) again", lambda x, w: F.linear(x, w))
    layer = layer_part(shapes, weights, device, args.replays)
    if args.out:
        kept = {"shape": args.shape, "floors_us": floors, "results": results, "layer": layer}
        args.out.write_text(json.dumps(kept))
    return 0


def layer_part(
    shapes: dict[str, tuple[int, int]],
    weights: list[dict[str, torch.Tensor]],
    device: torch.device,
    replays: int,
) -> dict[str, float]:
    """µs a layer of the linear part: cuBLAS, then the GEMV (unfused kernels)."""
    from asyncstep.ops.triton.fused import fused_add_rms_norm, silu_and_mul

    hidden = shapes["o"][0]
    dt = torch.bfloat16
    norm_w = torch.rand(hidden, device=device, dtype=dt) + 0.5
    h0, r0 = (
        torch.randn(1, hidden, device=device, dtype=dt),
        torch.randn(1, hidden, device=device, dtype=dt),
    )
    attn_out = torch.randn(1, shapes["o"][1], device=device, dtype=dt) * 0.1
    outs: dict[str, torch.Tensor] = {}

    def unfused(gemv: bool) -> None:
        def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return dense_gemv(x, w) if gemv else F.linear(x, w)

        h, r = h0, r0
        for w in weights:
            x, r = fused_add_rms_norm(h, r, norm_w, 1e-5)
            mm(x, w["qkv"])
            o = mm(attn_out, w["o"])
            x, r = fused_add_rms_norm(o, r, norm_w, 1e-5)
            h = mm(silu_and_mul(mm(x, w["gate_up"])), w["down"])
        outs["gemv" if gemv else "cublas"] = h + r

    runs: dict[str, Callable[[], None]] = {
        "cublas_unfused": lambda: unfused(False),
        "gemv_unfused": lambda: unfused(True),
        "cublas_unfused_again": lambda: unfused(False),
    }
    times = {name: time_graph(fn, replays) / len(weights) * 1e6 for name, fn in runs.items()}
    ref = outs["cublas"].float()
    for name in ("gemv",):
        error = float((outs[name].float() - ref).norm() / ref.norm())
        print(f"layer output, {name} against cuBLAS unfused: rel error {error:.2e}")
    for name, us in times.items():
        print(f"layer's linear part {name:22s} {us:7.1f} us")
    return times


if __name__ == "__main__":
    raise SystemExit(main())
