"""CPU benchmark of a decoder layer's non-matmul work: the CPU library's
layer ops (``cpu_kernels.c``: residual add + RMSNorm over a float32 residual
stream, ``silu(gate) * up``) against the torch ops they replace, with
SmolLM2-135M's sizes (hidden 576, ffn 1536), then whole SmolLM2 steps with
the ops switched on and off.

``ops`` (the default) times one call each at M rows (1, 64, 2048): the
torch expression (``RMSNorm.forward_residual`` in float32_residual mode:
``residual + x``, ``F.rms_norm``, ``.to(bf16)``; ``F.silu(gate) * up``)
against the kernel (the norm out of place and in place, as the model calls
it), in bfloat16 and float32, with 1 and 2 threads. ``--model-step`` times
whole steps of the embedded SmolLM2 (forward and logits, the CPU attention
kernel with the rotary fused, as the runner runs them; weights as the
loader packs them): decode batches (contexts 129..192) and one 2048-token
prompt; ``--profile`` adds each variant's share of time per torch op in
one step of each kind.

Variants run interleaved (each round times every variant; a figure is the
best call over ``--rounds`` x ``--repeats``), so a busy machine slows them
alike: read the ratios. The load average is printed before and after. E.g.

    python benchmarks/studies/cpu_kernels/cpu_layer_ops.py \\
        --out benchmarks/results/cpu/cpu_layer_ops.json
    python benchmarks/studies/cpu_kernels/cpu_layer_ops.py --model-step --profile \\
        --out benchmarks/results/cpu/cpu_layer_ops_model_step.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from asyncstep.config import ModelConfig
from asyncstep.models.layers.attention import AttentionMetadata, kv_cache_shape
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.models.model_loader import load_model
from asyncstep.ops import TORCH_OPS, select_ops
from asyncstep.ops.cpu.library import load_cpu_kernels

sys.path.insert(0, str(Path(__file__).parent))
from cpu_attention import BLOCK, DIM, KV_HEADS, best_us, make_case

from asyncstep.bench.study import write_results

HIDDEN, FFN, EPS = 576, 1536, 1e-5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Variant = Callable[[], object]


def load_line(when: str) -> str:
    return f"load average {when}: {', '.join(f'{x:.2f}' for x in os.getloadavg())}"


# -- one op -----------------------------------------------------------------------------


def norm_variants(rows: int, dtype: torch.dtype) -> dict[str, Variant]:
    """add + RMSNorm of one layer: torch's ops, the kernel out of place and in place."""
    ops = load_cpu_kernels()
    assert ops is not None, "the CPU kernels do not build here"
    x = torch.randn(rows, HIDDEN).to(dtype)
    residual, weight = torch.randn(rows, HIDDEN) * 10, torch.rand(HIDDEN)
    owned = residual.clone()

    def torch_ops() -> object:
        r = residual + x
        return F.rms_norm(r, weight.shape, weight, EPS).to(dtype), r

    return {
        "torch": torch_ops,
        "kernel": partial(ops.layer_ops.add_rms_norm, x, residual, weight, EPS),
        "kernel_in_place": partial(
            ops.layer_ops.add_rms_norm, x, owned, weight, EPS, in_place=True
        ),
    }


def silu_variants(rows: int, dtype: torch.dtype) -> dict[str, Variant]:
    ops = load_cpu_kernels()
    assert ops is not None, "the CPU kernels do not build here"
    gate_up = torch.randn(rows, 2 * FFN).to(dtype)

    def torch_ops() -> object:  # as LlamaMLP.forward runs them
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    return {"torch": torch_ops, "kernel": partial(ops.layer_ops.silu_and_mul, gate_up)}


def time_variants(variants: dict[str, Variant], args: argparse.Namespace) -> dict[str, float]:
    """Best microseconds of each variant, interleaved over the rounds."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(best_us(fn, args.repeats))
    return {name: min(runs) for name, runs in times.items()}


def op_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dtype_name in args.dtype:
        for m in args.rows:
            for threads in args.threads:
                torch.set_num_threads(threads)
                for op, make in (("add_rms_norm", norm_variants), ("silu_and_mul", silu_variants)):
                    us = time_variants(make(m, DTYPES[dtype_name]), args)
                    row = {"op": op, "rows": m, "dtype": dtype_name, "threads": threads}
                    row |= {f"{name}_us": t for name, t in us.items()}
                    row["speedup"] = us["torch"] / us["kernel"]
                    rows.append(row)
                    print(format_op_row(row), flush=True)
    return rows


def format_op_row(row: dict[str, Any]) -> str:
    cells = [f"{row['op']:13s} M={row['rows']:<5d} {row['dtype']:8s} t{row['threads']}"]
    cells += [f"torch {row['torch_us']:9.1f} us", f"kernel {row['kernel_us']:9.1f} us"]
    if "kernel_in_place_us" in row:
        cells.append(f"in place {row['kernel_in_place_us']:9.1f} us")
    return "  ".join(cells) + f"  x{row['speedup']:.2f}"


# -- whole steps ------------------------------------------------------------------------


@dataclass
class Step:
    """One step of the loaded model over its own KV caches."""

    name: str
    model: LlamaForCausalLM
    ids: torch.Tensor
    meta: AttentionMetadata

    @classmethod
    def build(
        cls, name: str, model: LlamaForCausalLM, decodes: list[int], prompt: int, dtype: torch.dtype
    ) -> Step:
        """``decodes``: context lengths of decoding requests; ``prompt``: the
        tokens of one new prompt (0: none)."""
        prompts = [(0, prompt)] if prompt else []
        meta = make_case(name, decodes, prompts, dtype, seed=len(decodes) + prompt).meta
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        positions = np.concatenate(
            [np.arange(s - (qsl[r + 1] - qsl[r]), s) for r, s in enumerate(lens)]
        )
        meta.positions = torch.from_numpy(positions).long()
        num_blocks = int(meta.block_table.max()) + 1
        for layer in model.attention_layers():
            layer.kv_cache = torch.zeros(
                kv_cache_shape(num_blocks, BLOCK, KV_HEADS, DIM), dtype=dtype
            )
            layer.backend, layer.fused_rotary = "cpu", model.model.rotary
        rng = np.random.default_rng(len(decodes))
        ids = torch.from_numpy(rng.integers(3, model.config.vocab_size, len(positions)))
        return cls(name, model, ids, meta)

    def run(self, kernels: bool) -> torch.Tensor:
        """One step with the layer ops switched ``kernels`` (the metadata's
        kernel arguments made anew, as each step makes them)."""
        use_layer_kernels(self.model, kernels)
        self.meta.kernel_args = None
        assert self.meta.positions is not None
        hidden = self.model(self.ids, self.meta.positions, self.meta)
        assert isinstance(hidden, torch.Tensor)
        logits: torch.Tensor = self.model.compute_logits(hidden)
        return logits


def use_layer_kernels(model: LlamaForCausalLM, on: bool) -> None:
    cpu = torch.device("cpu")
    model.use_ops(select_ops(cpu, "torch", fused_kernels=True) if on else TORCH_OPS)


def model_steps(args: argparse.Namespace, dtype_name: str) -> list[dict[str, Any]]:
    """Steps of SmolLM2 per kind, the layer ops on and off interleaved."""
    loaded = load_model(ModelConfig(device="cpu", dtype=dtype_name), with_tokenizer=False)
    model, dtype, rng = loaded.model, DTYPES[dtype_name], np.random.default_rng(0)
    kinds = [(f"decode b{b}", rng.integers(129, 193, b).tolist(), 0) for b in args.batch]
    kinds += [(f"prefill {p}", [], p) for p in args.prompt]
    rows = []
    for name, decodes, prompt in kinds:
        step = Step.build(name, model, decodes, prompt, dtype)
        same = torch.equal(step.run(True), step.run(False))
        for threads in args.threads:
            torch.set_num_threads(threads)
            variants = {"torch": partial(step.run, False), "kernels": partial(step.run, True)}
            ms = {k: v / 1e3 for k, v in time_variants(variants, args).items()}
            row = {"case": f"SmolLM2 {name}", "dtype": dtype_name, "threads": threads}
            row |= {f"{k}_step_ms": v for k, v in ms.items()}
            row |= {"speedup": ms["torch"] / ms["kernels"], "same_logits": same}
            if args.profile and threads == args.threads[0]:
                row["profile"] = {k: op_shares(fn) for k, fn in variants.items()}
            rows.append(row)
            print(
                f"{row['case']:24s} {dtype_name} t{threads}  torch ops {ms['torch']:8.2f} ms"
                f"  layer kernels {ms['kernels']:8.2f} ms  x{row['speedup']:.3f}"
                f"  logits equal: {same}",
                flush=True,
            )
    return rows


def op_shares(step: Variant, top: int = 8) -> dict[str, float]:
    """Share of one step's wall time per torch op (self time, the ``top``
    largest), and outside any torch op (Python, the library's kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - start) * 1e6
    events = sorted(
        ((e.key, e.self_cpu_time_total) for e in prof.key_averages()), key=lambda e: -e[1]
    )
    shares = {key: round(t / wall_us, 4) for key, t in events[:top]}
    shares["outside torch ops"] = round(1 - sum(t for _, t in events) / wall_us, 4)
    return shares


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 2048])
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, help="default: 5 for ops, 3 for model steps")
    p.add_argument("--repeats", type=int, help="default: 20 for ops, 3 for model steps")
    p.add_argument("--model-step", action="store_true", help="whole SmolLM2 steps")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt", type=int, nargs="+", default=[2048])
    p.add_argument("--profile", action="store_true", help="with --model-step: torch op shares")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args()
    args.rounds = args.rounds or (3 if args.model_step else 5)
    args.repeats = args.repeats or (3 if args.model_step else 20)
    return args


def main() -> int:
    args = parse_args()
    load_before = os.getloadavg()
    print(f"{load_line('before')}; {os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    with torch.inference_mode():
        if args.model_step:
            rows = [row for name in args.dtype for row in model_steps(args, name)]
        else:
            rows = op_rows(args)
    load_after = os.getloadavg()
    print(load_line("after"))
    if args.out is not None:
        write_results(
            args.out,
            rows,
            load_average_before=load_before,
            load_average_after=load_after,
            cpu_count=os.cpu_count(),
            shape={"hidden": HIDDEN, "ffn": FFN},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
