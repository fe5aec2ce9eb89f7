"""One step's packed matmuls of SmolLM2 on the CPU, per kernel, in one run:
30 layers of 4-bit weights of its four shapes (distinct, so they stream
from memory as a step reads them) and its 8-bit LM head, at 1 to 16 rows,
through the CPU library's Q4 / Q8 blocks (``cpu_quant.c``) with one and two
activation levels, torch's int4 / int8 packing, and the dense weights
(``F.linear``) in ``--dtype`` (default: the CPU's, bfloat16 where it
multiplies it natively, else float32; the activations too). Best of
``--repeats``, milliseconds a step; the packed bytes a step reads, and the
rate they are read at.

    python3 benchmarks/studies/cpu_kernels/cpu_quant_matmul.py \\
        --out benchmarks/results/cpu/cpu_quant_matmul.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial

import torch
import torch.nn.functional as F

from asyncstep.models.model_loader import resolve_dtype
from asyncstep.ops.cpu.quant import pack_q4_cpu, pack_q8_cpu, quant_matmul
from asyncstep.ops.packed import GROUP_SIZE, PackedWeight, pack_int4, pack_int8_rows

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def q4_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """As a GGUF Q4_1 tensor dequantizes (codes 0 and 15 in every block)."""
    blocks = cols // GROUP_SIZE
    d = (torch.rand(rows, blocks, 1, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(rows, blocks, 1, generator=gen) * 0.1).half().float()
    q = torch.randint(0, 16, (rows, blocks, GROUP_SIZE), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(rows, cols)


def q8_weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    blocks = cols // GROUP_SIZE
    d = (torch.rand(rows, blocks, 1, generator=gen) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (rows, blocks, GROUP_SIZE), generator=gen).float()
    q[..., 0] = 127
    return (d * q).reshape(rows, cols)


def run_packed(packed: list, xs: dict[int, torch.Tensor]) -> None:
    for p in packed:
        p.mm(xs[p.in_features])


def run_dense(weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    for w in weights:
        F.linear(xs[w.shape[1]], w)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    matmul = quant_matmul()
    if matmul is None or not matmul.fast:
        raise SystemExit(
            "the CPU library's quantized matmuls do not run here (no AVX512-VNNI, no AVX2)"
        )
    gen = torch.Generator().manual_seed(0)
    dense = [q4_weight(*SHAPES[name], gen) for _ in range(LAYERS) for name in SHAPES]
    head = q8_weight(VOCAB, HIDDEN, gen)
    layers: dict[str, list] = {
        "blocks, 1 level": [pack_q4_cpu(w, dtype, 64, 1) for w in dense],
        "blocks, 2 levels": [pack_q4_cpu(w, dtype, 64, 2) for w in dense],
        "torch int4": [pack_int4(w, dtype, 64) for w in dense],
    }
    heads: dict[str, PackedWeight | None] = {
        "blocks, 1 level": pack_q8_cpu(head, dtype, 64, 1),
        "blocks, 2 levels": pack_q8_cpu(head, dtype, 64, 2),
        "torch int4": pack_int8_rows(head, dtype, 64),  # its LM head: int8 rows
    }
    assert all(h is not None for h in heads.values()), "the weights are on their grids"
    dense_weights = [w.to(dtype) for w in dense]
    dense_head = head.to(dtype)
    nbytes = {k: sum(p.nbytes for p in v) for k, v in layers.items()}
    results: list[dict[str, object]] = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (576, 1536)}
        row: dict[str, object] = {"rows": rows}
        for kind, packed in layers.items():
            row[f"{kind}: layers ms"] = best_ms(partial(run_packed, packed, xs), args.repeats)
            head_mm = heads[kind].mm  # type: ignore[union-attr]
            row[f"{kind}: head ms"] = best_ms(partial(head_mm, xs[HIDDEN]), args.repeats)
        row[f"{name}: layers ms"] = best_ms(partial(run_dense, dense_weights, xs), args.repeats)
        row[f"{name}: head ms"] = best_ms(partial(F.linear, xs[HIDDEN], dense_head), args.repeats)
        results.append(row)
        print(
            f"rows {rows:3d}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "rows"),
            flush=True,
        )
    one = results[0]
    rates = {
        k: nbytes[k] / (float(one[f"{k}: layers ms"]) * 1e-3) / 1e9  # type: ignore[arg-type]
        for k in layers
    }
    print("GB/s of packed bytes, first rows:", {k: round(r, 1) for k, r in rates.items()})
    if args.out:
        out = {
            "command": "python3 benchmarks/studies/cpu_kernels/cpu_quant_matmul.py "
            + " ".join(
                f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items()
                if v is not None
            ),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {
                "cores": len(os.sched_getaffinity(0)),
                "threads": torch.get_num_threads(),
                "isa": matmul.isa,
                "dtype": str(dtype),
            },
            "load_avg_after": os.getloadavg(),
            "packed_bytes": nbytes,
            "gb_s_first_rows": rates,
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
