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


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
