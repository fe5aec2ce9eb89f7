"""Would a Triton GEMV of our own keep cuBLAS's rate on bf16 weights at one
row (issue 28)? The fused decode folds the norms, SiLU·mul and residual adds
into the Q4 GEMV; for bf16 weights that needs a GEMV of ours as fast as
cuBLAS's (its GEMVs move ~3.7 TB/s on llama-8b). This measures the plain
product first, before any epilogue is built on it.

For a model shape's four linear layers (qkv, o, gate_up, down), ``--layers``
distinct layers in one CUDA graph (the weights stream from HBM), median of
``--replays`` replays, µs a layer: ``F.linear`` (cuBLAS) and the kernel
below under several launches, each checked against ``F.linear`` first.

    python3 benchmarks/dense_gemv.py [--shape llama-8b] [--out results.json]
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
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.quant_gpu import copy_bandwidth, layer_shapes, time_graph

#: (BLOCK_N, BLOCK_K, warps, split-free prefetch of the next chunk)
LAUNCHES = [
    (n, k, w, pf)
    for n, k, w, pf in [
        (4, 256, 2, False),
        (4, 512, 4, False),
        (8, 256, 2, False),
        (8, 256, 4, False),
        (8, 512, 4, False),
        (8, 256, 2, True),
        (8, 512, 4, True),
        (16, 128, 2, False),
        (16, 256, 4, False),
        (2, 512, 2, False),
        (2, 1024, 4, False),
        (4, 1024, 4, False),
    ]
]


@triton.jit
def _dense_gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """``out[n] = sum_k w[n, k] x[k]`` for this program's BLOCK_N rows (every
    shape divides: no masks), float32 accumulation, one row of x."""
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    rows = w_ptr + n[:, None] * K + k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH:
        w_next = tl.load(rows)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            w = w_next
            w_next = tl.load(rows + tl.where(k0 + BLOCK_K < K, k0 + BLOCK_K, 0))
        else:
            w = tl.load(rows + k0)
        x = tl.load(x_ptr + k0 + k).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))


def dense_gemv(
    x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, warps: int, prefetch: bool
) -> torch.Tensor:
    n, k = w.shape
    assert x.shape == (1, k) and n % block_n == 0 and k % block_k == 0
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _dense_gemv_kernel[(n // block_n,)](
        x, w, out, k, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch, num_warps=warps
    )
    return out


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
            name: torch.randn(n, k, device=device).bfloat16() * 0.02
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
    for bn, bk, warps, pf in LAUNCHES:
        if any(n % bn or k % bk for n, k in shapes.values()):
            continue  # every tile full: a launch whose tiles divide each shape
        variant(
            f"n{bn} k{bk} w{warps} pf={int(pf)}",
            lambda x, w, c=(bn, bk, warps, pf): dense_gemv(x, w, *c),
        )
    variant("F.linear (cuBLAS) again", lambda x, w: F.linear(x, w))
    best = {
        name: min(
            (r for r in results if "cuBLAS" not in r["launch"]),
            key=lambda r: r["us_per_shape"][name],
        )
        for name in shapes
    }
    print("best launch per shape (us) against cuBLAS (first run):")
    for name, r in best.items():
        print(
            f"  {name:8s} {r['launch']:20s} {r['us_per_shape'][name]:6.1f} "
            f"(cuBLAS {results[0]['us_per_shape'][name]:6.1f}, floor {floors[name]:6.1f})"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"shape": args.shape, "floors_us": floors, "results": results})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
