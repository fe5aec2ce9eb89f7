"""Q4 linear layers on the GPU against bf16 (``asyncstep.ops.triton.quant``).

For a model shape's four linear layers (qkv, o, gate_up, down) of several
distinct layers (so the weights stream from HBM, not L2), one CUDA graph per
variant runs every layer's four products; its replay time per layer is the
figure. Variants: bf16 dense (``F.linear``), the Q4 GEMV (several launch
configurations), the dequantizing GEMM (several tiles), and dequantize +
matmul; each Q4 variant is first checked against the dequantized weight.
Bytes: the weights each layer reads (bf16: 2 per weight; Q4: 0.5 + 4 per 32
for the scales); ``GB/s`` is those bytes over the time. With ``--lm-head``,
first the LM head at one row: bf16 against the Q8 GEMV (1 + 4 / 32 bytes a
weight), several launches.

    python3 benchmarks/studies/decode_kernels/quant_gpu.py \\
        --out results.json [--rows 1 32] [--quick] [--lm-head]
        [--launch BLOCK_N,BLOCK_G,WARPS,PREFETCH,STAGES[,INT8] ...]  (these GEMV launches instead)
        [--lm-launch BLOCK_N,BLOCK_G,WARPS,PREFETCH,STAGES[,INT8] ...]  (and these on the LM head)

A launch's INT8 (0 / 1): x quantized per block to int8 and multiplied by
``dp4a`` (``asyncstep.ops.triton.quant_packed``), else the exact float32 products.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

from asyncstep.models.dummy import get_shape
from asyncstep.ops.triton import quant as tq

#: Every GEMV launch tried at one row (the best few also at 2 and 4 rows):
#: (block_n, block_g, num_warps, prefetch, stages); a warp's lanes go along the blocks.
GEMV_CONFIGS = [
    tq.GemvConfig(*launch)
    for launch in [
        (8, 64, 2, False, 1),
        (8, 64, 2, True, 1),
        (8, 128, 4, False, 1),
        (8, 32, 1, False, 2),
        (8, 32, 1, False, 3),
        (8, 32, 1, False, 4),
        (8, 64, 2, False, 2),
        (8, 64, 2, False, 3),
        (4, 32, 1, False, 4),
        (8, 16, 1, False, 4),
        (16, 32, 1, False, 3),
        (4, 64, 2, False, 3),
    ]
]
#: GEMV launches tried on the LM head (8-bit codes).
LM_HEAD_CONFIGS = [
    tq.GemvConfig(*launch)
    for launch in [
        (8, 32, 2, False, 1),
        (4, 64, 4, False, 1),
        (8, 32, 2, False, 3),
        (8, 16, 1, False, 4),
        (4, 32, 2, False, 3),
        (8, 64, 4, False, 3),
    ]
]
#: (block_n, block_g, num_warps, num_stages, swap)
DOT_CONFIGS = [
    (bn, bg, 4, stages, swap)
    for swap in (False, True)
    for bn, bg, stages in [(16, 8, 3), (16, 4, 3), (32, 4, 3), (32, 8, 3), (64, 4, 3), (32, 4, 4)]
]


def parse_launch(launch: str) -> tq.GemvConfig:
    """A GEMV launch from ``BLOCK_N,BLOCK_G,WARPS,PREFETCH,STAGES[,INT8]``."""
    n, g, w, pf, st, *int8 = map(int, launch.split(","))
    return tq.GemvConfig(n, g, w, bool(pf), st, bool(int8 and int8[0]))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (median)."""
    if device.type != "cuda":
        return math.nan
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / sorted(times)[len(times) // 2]


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of one decoder layer."""
    a = get_shape(shape)
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    h, i = a.hidden_size, a.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def time_graph(fn: Callable[[], None], replays: int) -> float:
    """Seconds per call of ``fn``, captured in a CUDA graph (median of replays;
    on the CPU, a smoke test: one timed call)."""
    if not torch.cuda.is_available():
        fn()
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 2048])
    parser.add_argument("--layers", type=int, default=4, help="distinct layers per graph")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="the first 3 configs of each kind")
    parser.add_argument(
        "--launch",
        action="append",
        default=[],
        help="a GEMV launch BLOCK_N,BLOCK_G,WARPS,PREFETCH(0/1),STAGES[,INT8(0/1)] to try instead"
        " (repeatable)",
    )
    parser.add_argument(
        "--lm-launch",
        action="append",
        default=[],
        help="a Q8 GEMV launch for the LM head, as --launch (repeatable)",
    )
    parser.add_argument(
        "--lm-head", action="store_true", help="also the LM head: bf16 against the Q8 GEMV"
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    shapes = layer_shapes(args.shape)
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    for _ in range(args.layers):
        layer = {}
        for name, (n, k) in shapes.items():
            groups = k // tq.GROUP_SIZE
            codes = torch.randint(0, 16, (n, k), device=device, dtype=torch.uint8)
            scale = (torch.rand(n, groups, device=device) * 0.01 + 1e-3).half()
            offset = (-torch.rand(n, groups, device=device) * 0.08).half()
            qweight, scales = tq.pack_q4(codes, scale, offset)
            del codes
            dense = tq.dequantize_q4(qweight, scales, torch.bfloat16)
            layer[name] = (qweight, scales, dense)
        weights.append(layer)
    elements = sum(n * k for n, k in shapes.values())
    bytes_bf16 = elements * 2
    bytes_q4 = elements // 2 + elements // tq.GROUP_SIZE * 4
    print(
        f"{args.shape}: {elements / 1e6:.1f} M weights a layer; bf16 {bytes_bf16 / 1e6:.1f} MB, "
        f"Q4 {bytes_q4 / 1e6:.1f} MB; floors {bytes_bf16 / bandwidth * 1e6:.1f} / "
        f"{bytes_q4 / bandwidth * 1e6:.1f} us a layer",
        flush=True,
    )
    gemv_configs = GEMV_CONFIGS[:3] if args.quick else GEMV_CONFIGS
    if args.launch:
        gemv_configs = [parse_launch(launch) for launch in args.launch]
    lm_head_configs = [parse_launch(launch) for launch in args.lm_launch] or LM_HEAD_CONFIGS
    dot_configs = DOT_CONFIGS[:3] if args.quick else DOT_CONFIGS
    rows_out: list[dict[str, Any]] = []

    def variant(rows: int, path: str, config: str, product: Callable[..., torch.Tensor]) -> None:
        """Check one Q4 path (or bf16) against the dequantized weight, then
        time it on each layer shape (a graph over the distinct layers)."""
        x = torch.randn(rows, max(k for _, k in shapes.values()), device=device).bfloat16()
        xs = {name: x[:, :k].contiguous() for name, (_, k) in shapes.items()}
        qweight, scales, dense = weights[0]["down"]
        got = product(xs["down"], qweight, scales, dense).float()
        want = xs["down"].float() @ dense.float().T
        error = float((got - want).norm() / want.norm())
        if not error < 2e-2:
            print(f"  M={rows:5d} {path:8s} {config:32s} WRONG: rel error {error:.2e}", flush=True)
            return
        per_shape = {}
        for name in shapes:

            def run(name: str = name) -> None:
                for layer in weights:
                    qw, sc, de = layer[name]
                    product(xs[name], qw, sc, de)

            per_shape[name] = time_graph(run, args.replays) / args.layers * 1e6
        total = sum(per_shape.values())
        moved = bytes_bf16 if path == "bf16" else bytes_q4
        rows_out.append(
            {
                "rows": rows,
                "path": path,
                "config": config,
                "us_per_layer": total,
                "us_per_shape": per_shape,
                "gb_s": moved / total / 1e3,
                "rel_error": error,
            }
        )
        shown = " ".join(f"{k} {v:6.1f}" for k, v in per_shape.items())
        print(
            f"  M={rows:5d} {path:8s} {config:32s} {total:8.1f} us/layer "
            f"{moved / total / 1e3:6.0f} GB/s | {shown}",
            flush=True,
        )

    def gemv_label(c: tq.GemvConfig) -> str:
        label = f"n{c.block_n} g{c.block_g} w{c.num_warps} pf={int(c.prefetch)} s{c.stages}"
        return label + (" int8" if c.int8 else "")

    lm_head: list[dict[str, Any]] = []
    if args.lm_head:
        a = get_shape(args.shape)
        n, k = a.vocab_size, a.hidden_size
        dense = torch.randn(n, k, device=device).bfloat16()
        blocks = dense.float().reshape(n, k // tq.GROUP_SIZE, tq.GROUP_SIZE)
        scale = blocks.abs().amax(dim=-1) / 127
        codes = torch.round(blocks / scale.clamp_min(1e-30).unsqueeze(-1)).to(torch.int64)
        qweight, scales = tq.pack_q8(codes.reshape(n, k), scale.half())
        del blocks, codes
        head_dense = tq.dequantize_q8_reference(qweight, scales)
        x = torch.randn(1, k, device=device).bfloat16()
        want = x.float() @ head_dense.T
        head_dense = head_dense.bfloat16()
        bytes_q8 = n * k + n * (k // tq.GROUP_SIZE) * 4
        runs: list[tuple[str, Callable[[], torch.Tensor], int]] = [
            ("bf16 F.linear", lambda: F.linear(x, head_dense), n * k * 2)
        ]
        for cfg in lm_head_configs:
            runs.append(
                (
                    f"q8 {gemv_label(cfg)}",
                    lambda c=cfg: tq.q8_gemv(x, qweight, scales, c),
                    bytes_q8,
                )
            )
        for label, fn, moved in runs:
            error = float((fn().float() - want).norm() / want.norm())

            def call(fn: Callable[[], torch.Tensor] = fn) -> None:
                fn()

            us = time_graph(call, args.replays) * 1e6
            lm_head.append({"path": label, "us": us, "gb_s": moved / us / 1e3, "rel_error": error})
            print(
                f"  LM head {n}x{k} {label:28s} {us:8.1f} us {moved / us / 1e3:6.0f} GB/s"
                f"  rel error {error:.1e}",
                flush=True,
            )
        del dense, head_dense, qweight, scales

    started = time.monotonic()
    top_gemv: list[tq.GemvConfig] = []
    for rows in args.rows:
        variant(rows, "bf16", "F.linear", lambda x, qw, sc, de: F.linear(x, de))
        if rows <= 4:
            configs = gemv_configs if rows == 1 or not top_gemv else top_gemv
            for cfg in configs:
                gemv = lambda x, qw, sc, de, c=cfg: tq.q4_gemv(x, qw, sc, c)  # noqa: E731
                variant(rows, "gemv", gemv_label(cfg), gemv)
            if rows == 1:
                ranked = sorted(
                    (r for r in rows_out if r["rows"] == 1 and r["path"] == "gemv"),
                    key=lambda r: r["us_per_layer"],
                )
                by_label = {gemv_label(c): c for c in gemv_configs}
                top_gemv = [by_label[r["config"]] for r in ranked[:4]]
        if 2 <= rows <= 256:
            for bn, bg, warps, stages, swap in dot_configs:
                label = f"n{bn} g{bg} w{warps} s{stages} swap={int(swap)}"
                variant(
                    rows,
                    "dot",
                    label,
                    lambda x, qw, sc, de, c=(bn, bg, warps, stages, swap): tq.q4_dot(
                        x,
                        qw,
                        sc,
                        block_n=c[0],
                        block_g=c[1],
                        num_warps=c[2],
                        num_stages=c[3],
                        swap=c[4],
                    ),
                )
        if rows >= 128:
            variant(
                rows,
                "dequant",
                "dequantize + F.linear",
                lambda x, qw, sc, de: F.linear(x, tq.dequantize_q4(qw, sc, x.dtype)),
            )
    print(f"swept in {time.monotonic() - started:.0f} s", flush=True)
    dense = {r["rows"]: r for r in rows_out if r["path"] == "bf16"}
    print("\nbest Q4 per M and layer shape (us a layer; bf16 / Q4 of the sum):")
    for rows in args.rows:
        candidates = [r for r in rows_out if r["rows"] == rows and r["path"] != "bf16"]
        if not candidates:
            continue
        total = 0.0
        for name in shapes:
            best = min(candidates, key=lambda r: r["us_per_shape"][name])
            total += best["us_per_shape"][name]
            mine, theirs = best["us_per_shape"][name], dense[rows]["us_per_shape"][name]
            print(
                f"  M={rows:5d} {name:8s} {best['path']:8s} {best['config']:32s}"
                f" {mine:7.1f} (bf16 {theirs:7.1f})"
            )
        bf16 = dense[rows]["us_per_layer"]
        print(f"  M={rows:5d} all      {total:7.1f} us (bf16 {bf16:7.1f})  x{bf16 / total:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "argv": sys.argv,
                    "device": name,
                    "torch": torch.__version__,
                    "bandwidth_tb_s": bandwidth / 1e12,
                    "shape": args.shape,
                    "bytes_per_layer": {"bf16": bytes_bf16, "q4": bytes_q4},
                    "rows": rows_out,
                    "lm_head": lm_head,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
