"""The few-row matmul of dense bf16 weights (``asyncstep.ops.triton.small_t_gemm``)
against cuBLAS (issue 43: batch 32 on the fast op set): for a model shape's
four linear layers (qkv, o, gate_up, down) at ``--rows`` rows, ``--layers``
distinct weights of each in one CUDA graph (the weights stream from HBM),
median of ``--replays`` replays, µs a weight: ``F.linear`` (cuBLAS), the
default launch and the launches of :data:`SWEEP`, each checked against
``F.linear`` first; the weight's bytes over the device-to-device copy's
rate (read + written) beside them: the floor, as `asyncstep bench` counts it.

    python3 benchmarks/studies/decode_kernels/small_t_gemm.py --shape llama-1b --rows 32 \\
        [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

from quant_gpu import copy_bandwidth, layer_shapes, time_graph

from asyncstep.ops.triton.small_t_gemm import SmallTLaunch, small_t_gemm, small_t_launch

#: Launches tried beside the default: (weight rows a program, features a
#: step, warps, stages).
SWEEP = [
    SmallTLaunch(bn, bk, w, s)
    for bn in (16, 32, 64)
    for bk in (128, 256, 512)
    for w in (4, 8)
    for s in (3, 4)
    if bn * bk <= 16384
]


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rate = copy_bandwidth(device)  # the floor's rate, as the bench's (read + write)
    report: dict[str, Any] = {"shape": args.shape, "rows": args.rows, "read_bytes_s": rate}
    for name, (n, k) in layer_shapes(args.shape).items():
        report[name] = one_weight(args, name, n, k, device, rate)
    return report


def one_weight(
    args: argparse.Namespace, name: str, n: int, k: int, device: torch.device, rate: float
) -> dict[str, Any]:
    """One weight shape's row of the report (µs a weight)."""
    ws = [
        torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(args.layers)
    ]
    x = torch.randn(args.rows, k, device=device, dtype=torch.bfloat16)
    want = F.linear(x, ws[0])
    row: dict[str, Any] = {"n": n, "k": k, "floor_us": n * k * 2 / rate * 1e6}

    def cublas() -> None:
        for w in ws:
            F.linear(x, w)

    row["cublas_us"] = time_graph(cublas, args.replays) / len(ws) * 1e6
    launches = {"default": small_t_launch(n, k), **{str(tuple(c)): c for c in SWEEP}}
    for label, cfg in launches.items():
        torch.testing.assert_close(small_t_gemm(x, ws[0], launch=cfg), want, rtol=2e-2, atol=2e-2)

        def ours(cfg: SmallTLaunch = cfg) -> None:
            for w in ws:
                small_t_gemm(x, w, launch=cfg)

        row[label] = time_graph(ours, args.replays) / len(ws) * 1e6
    best = min((v, key) for key, v in row.items() if key.startswith("(") or key == "default")
    print(
        f"{args.shape} {name} [{n}, {k}] x {args.rows} rows: cuBLAS {row['cublas_us']:.1f} us, "
        f"default {row['default']:.1f}, best {best[0]:.1f} {best[1]}, "
        f"floor {row['floor_us']:.1f}",
        flush=True,
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
