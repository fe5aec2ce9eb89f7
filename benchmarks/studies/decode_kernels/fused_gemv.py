"""A decoder layer's linear part at one row, unfused against the fused
decode (``asyncstep.models.fused_decode``), on random Q4 weights.

Unfused (what the model ran before): add + RMSNorm, qkv GEMV, o GEMV, add +
RMSNorm, gate_up GEMV, SiLU·mul, down GEMV: seven kernels. Fused: qkv (the
norm from the parts), o (residual add, the next norm's parts), gate_up (the
norm from the parts, SiLU·mul of interleaved rows), down (residual add, the
next norm's parts): four. The attention is left out (its output is a fixed
tensor). ``--layers`` distinct layers in one CUDA graph (the weights stream
from HBM), median of ``--replays`` replays, µs a layer; each variant's
output is checked against the other's first.

    python3 benchmarks/studies/decode_kernels/fused_gemv.py [--shape llama-8b] [--out results.json]
        [--int8]  (every GEMV quantizes x per block to int8: gpu_q4_activations int8)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

from quant_gpu import copy_bandwidth, layer_shapes, time_graph

from asyncstep.ops.triton.fused import fused_add_rms_norm, silu_and_mul
from asyncstep.ops.triton.quant import (
    GROUP_SIZE,
    NormedRows,
    interleave_pairs,
    pack_q4,
    q4_gemv,
    q4_gemv_fused,
)

Packed = tuple[torch.Tensor, torch.Tensor]


def random_packed(n: int, k: int, device: torch.device) -> Packed:
    groups = k // GROUP_SIZE
    codes = torch.randint(0, 16, (n, k), device=device)
    scale = (torch.rand(n, groups, device=device) * 0.02 + 0.002).half()
    offset = -8 * scale
    return pack_q4(codes, scale, offset)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--int8", action="store_true", help="the GEMVs' int8 activations")
    args = parser.parse_args()
    int8 = bool(args.int8)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = layer_shapes(args.shape)
    hidden = shapes["o"][0]
    layers = []
    for _ in range(args.layers):
        w = {name: random_packed(n, k, device) for name, (n, k) in shapes.items()}
        w["gate_up_pairs"] = interleave_pairs(*w["gate_up"])
        layers.append(w)
    dt = torch.bfloat16
    norm_w = torch.rand(hidden, device=device, dtype=dt) + 0.5
    h0 = torch.randn(1, hidden, device=device, dtype=dt)
    r0 = torch.randn(1, hidden, device=device, dtype=dt)
    s0 = h0 + r0  # the fused decode's stream in
    attn_out = torch.randn(1, shapes["o"][1], device=device, dtype=dt) * 0.1
    outs: dict[str, torch.Tensor] = {}

    def unfused() -> None:
        h, r = h0, r0
        for w in layers:
            x, r = fused_add_rms_norm(h, r, norm_w, 1e-5)
            q4_gemv(x, *w["qkv"], int8_x=int8)
            o = q4_gemv(attn_out, *w["o"], int8_x=int8)
            x, r = fused_add_rms_norm(o, r, norm_w, 1e-5)
            act = silu_and_mul(q4_gemv(x, *w["gate_up"], int8_x=int8))
            h = q4_gemv(act, *w["down"], int8_x=int8)
        outs["unfused"] = h + r

    def fused() -> None:
        stream: torch.Tensor = s0
        normed: NormedRows | None = None
        for w in layers:
            if normed is None:
                q4_gemv_fused(stream, *w["qkv"], rms_norm_weight=norm_w, eps=1e-5, int8_x=int8)
            else:
                q4_gemv_fused(
                    normed.xw,
                    *w["qkv"],
                    sq_parts=normed.sq_parts,
                    eps=1e-5,
                    out_dtype=dt,
                    int8_x=int8,
                )
            stream, normed = q4_gemv_fused(
                attn_out, *w["o"], residual=stream, next_rms_norm_weight=norm_w, int8_x=int8
            )
            assert normed is not None
            act, _ = q4_gemv_fused(
                normed.xw,
                *w["gate_up_pairs"],
                sq_parts=normed.sq_parts,
                eps=1e-5,
                silu_pairs=True,
                out_dtype=dt,
                int8_x=int8,
            )
            stream, normed = q4_gemv_fused(
                act, *w["down"], residual=stream, next_rms_norm_weight=norm_w, int8_x=int8
            )
        outs["fused"] = stream

    unfused()
    fused()
    err = float(
        (outs["fused"].float() - outs["unfused"].float()).norm() / outs["unfused"].float().norm()
    )
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    q4_bytes = sum(n * k * (0.5 + 4 / 32) for n, k in shapes.values())
    results = {
        "shape": args.shape,
        "int8": bool(args.int8),
        "rel_error_fused_vs_unfused": err,
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "floor_us_a_layer": q4_bytes / bandwidth * 1e6,
    }
    for name, fn in (("unfused", unfused), ("fused", fused), ("unfused_again", unfused)):
        results[f"{name}_us_a_layer"] = time_graph(fn, args.replays) / args.layers * 1e6
    for key, value in results.items():
        print(f"{key:28s} {value}")
    if args.out:
        args.out.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
