"""gpt-oss's experts kept MXFP4 on the CPU against the same experts
dequantized to float32 (issue 41): the library's grouped experts
(``cpu_moe.c``) on a gpt-oss-like small shape at 1, 16 and 64 rows
(medians, packed and dense alternated), and a tiny random gpt-oss's tensor
bytes loaded both ways.

    PYTHONPATH=$PWD nice -n 19 python3 benchmarks/studies/moe/mxfp4_experts.py --out r.json
    (--threads 1: one thread, steadier beside other load)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from asyncstep.ops.cpu.moe import moe_experts
from asyncstep.ops.mxfp4 import Mxfp4Weight


def experts_shape(args: argparse.Namespace) -> tuple[Mxfp4Weight, Mxfp4Weight]:
    """Random MXFP4 experts ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``."""
    g = torch.Generator().manual_seed(0)

    def one(rows: int, cols: int) -> Mxfp4Weight:
        blocks = torch.randint(0, 256, (args.experts, rows, cols // 32, 16), generator=g)
        scales = torch.randint(118, 124, (args.experts, rows, cols // 32), generator=g)
        return Mxfp4Weight.from_checkpoint(blocks.to(torch.uint8), scales.to(torch.uint8))

    return one(2 * args.inter, args.hidden), one(args.hidden, args.inter)


def time_experts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median ms a call, packed and dense alternated, per row count."""
    kernel = moe_experts()
    assert kernel is not None, "the CPU library does not build here"
    p13, p2 = experts_shape(args)
    d13, d2 = p13.dequantize(), p2.dequantize()
    b13 = torch.randn(args.experts, 2 * args.inter) * 0.1
    b2 = torch.randn(args.experts, args.hidden) * 0.1
    rows_out = []
    for rows in args.rows:
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, args.hidden, generator=g)
        logits = torch.randn(rows, args.experts, generator=g)
        weights, ids = torch.topk(logits.softmax(-1), args.top_k)
        ids = ids.int()
        times: dict[str, list[float]] = {"packed": [], "dense": []}
        variants = {"packed": (p13, p2), "dense": (d13, d2)}
        outs = {}
        for _ in range(args.iters):
            for name, (w13, w2) in variants.items():
                start = time.perf_counter()
                outs[name] = kernel(x, w13, w2, weights, ids, "swigluoai", b13, b2)
                times[name].append((time.perf_counter() - start) * 1e3)
        assert torch.equal(outs["packed"], outs["dense"]), "packed != dense bits"
        row = {"rows": rows} | {f"{k}_ms": statistics.median(v) for k, v in times.items()}
        row["dense_over_packed"] = row["dense_ms"] / row["packed_ms"]
        rows_out.append(row)
        print(
            f"rows {rows:3d}: packed {row['packed_ms']:8.2f} ms  dense {row['dense_ms']:8.2f} ms"
            f"  dense/packed {row['dense_over_packed']:.2f}",
            flush=True,
        )
    return rows_out


def model_bytes(packed: bool) -> dict[str, int]:
    """A tiny random MXFP4 gpt-oss (dummy weights) loaded float32 on the
    CPU: its tensors' bytes (parameters, buffers, packed experts)."""
    import transformers

    from asyncstep.models.dummy import dummy_weights
    from asyncstep.models.gpt_oss import GptOssForCausalLM
    from asyncstep.models.hf_config import parse_hf_config
    from asyncstep.models.layers.moe import FusedMoE

    config = transformers.GptOssConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=16,
        num_experts_per_tok=4,
        sliding_window=128,
    ).to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    config["quantization_config"] = {"quant_method": "mxfp4"}
    arch = parse_hf_config(config)
    GptOssForCausalLM.mxfp4_packed = packed
    try:
        model = GptOssForCausalLM(arch)
        model.load_weights(dummy_weights(arch))
    finally:
        GptOssForCausalLM.mxfp4_packed = True
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    held = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    packed_bytes = sum(
        w.nbytes for m in experts for w in (m.w13_mxfp4, m.w2_mxfp4) if w is not None
    )
    dense_experts = sum(m.w13_weight.nbytes + m.w2_weight.nbytes for m in experts)
    return {
        "tensor_bytes": held + packed_bytes,
        "expert_bytes": packed_bytes + dense_experts,
        "packed_expert_bytes": packed_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch's (default: its own)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}", flush=True)
    result: dict[str, Any] = {"shape": vars(args) | {"threads": torch.get_num_threads()}}
    result["load_before"] = os.getloadavg()[0]
    result["experts"] = time_experts(args)
    result["load_after"] = os.getloadavg()[0]
    result["model"] = {"packed": model_bytes(True), "dense": model_bytes(False)}
    print(json.dumps(result["model"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
