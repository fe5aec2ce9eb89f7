"""CPU micro-benchmark of one layer's paged attention with SmolLM2-135M's
heads (9 query / 3 KV, head_dim 64; block size 16, random block ids): the
torch reference (``write_kv_cache`` + ``reference_attention``, decodes in
the runner's buckets) against the CPU kernel (in ``cpu_kernels.c``: store and
attend in one call), on decode batches (ragged lengths in [3/4, 1] of the
context), mixed steps (decodes + a prompt chunk) and prompts, in fp32 and
bf16, with 1 and 2 torch threads.

Variants run interleaved (each round times every variant; a variant's
figure is its best call over ``--rounds`` x ``--repeats``), so a busy
machine slows them alike: read the ratios. ``err`` is the largest absolute
difference to the reference computed in float64 on the same inputs.
``--alternatives`` adds decode-only torch formulations tried for the kernel's
place: ``gather_bmm`` (one ``index_select`` of whole blocks per step,
laid out [kv_heads * batch, keys, dim] so both matmuls take it without a
copy, tail masked), ``gather_sdpa`` (the same gather, SDPA with a mask) and,
with ``--compiled``, ``compiled`` (``torch.compile`` of a gather-fused decode
attention, dynamic shapes; its first-call seconds are reported). E.g.

    python benchmarks/studies/cpu_kernels/cpu_attention.py --alternatives --compiled \\
        --out benchmarks/results/cpu/cpu_attention.json

``--model-step`` instead times whole decode steps of the embedded SmolLM2
(forward and logits; contexts 129..192, as 128-token prompts generating 64
tokens), the model's attention layers switched between the two backends
each round: the reference's step includes its bucket plan and the torch
rotary, the kernel's step has the rotary fused in (as the runner runs it).
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
from asyncstep.models.layers.attention import (
    AttentionMetadata,
    kv_cache_shape,
    plan_decode_buckets,
    reference_attention,
    reference_attention_backends,
    write_kv_cache,
)
from asyncstep.models.model_loader import load_model
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.paged_attention import cpu_step_args

sys.path.insert(0, str(Path(__file__).parent))
from asyncstep.bench.study import write_results

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
GROUP = HEADS // KV_HEADS
SCALE = DIM**-0.5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Case:
    """One step's attention inputs (one layer)."""

    name: str
    q: torch.Tensor  # [tokens, heads * dim]
    k: torch.Tensor  # [tokens, kv_heads * dim]
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata

    @property
    def decode_only(self) -> bool:
        return self.meta.num_decodes == self.meta.num_reqs


def make_case(
    name: str, decode_lens: list[int], prompts: list[tuple[int, int]], dtype: torch.dtype, seed: int
) -> Case:
    """Decodes of lengths ``decode_lens``, then prompt chunks ``(cached
    prefix, new tokens)``; every block at a random place in the cache."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1] * len(decode_lens) + [n for _, n in prompts]
    seq_lens = np.array(decode_lens + [c + n for c, n in prompts], dtype=np.int32)
    per_req = -(-seq_lens // BLOCK)
    num_blocks = int(per_req.sum())
    kv_cache = torch.randn(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, DIM), generator=gen)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), int(per_req.max()), dtype=torch.int32)
    starts = np.concatenate([[0], np.cumsum(per_req)])
    for r in range(len(seq_lens)):
        table[r, : per_req[r]] = order[starts[r] : starts[r + 1]]
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    positions = np.concatenate(
        [np.arange(s - (qsl[r + 1] - qsl[r]), s) for r, s in enumerate(seq_lens)]
    )
    rows = np.repeat(np.arange(len(seq_lens)), np.diff(qsl))
    slots = table[rows, positions // BLOCK].long() * BLOCK + torch.from_numpy(positions % BLOCK)
    tokens = int(qsl[-1])
    meta = AttentionMetadata(
        num_actual_tokens=tokens,
        num_decodes=len(decode_lens),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=table,
        slot_mapping=slots,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    q, k, v = (
        torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
        .to(dtype)
        .split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], -1)
    )
    return Case(name, q, k, v, kv_cache.to(dtype), meta)


def workloads(args: argparse.Namespace, dtype: torch.dtype) -> list[Case]:
    rng = np.random.default_rng(0)
    cases = []
    for batch in args.batch:
        for ctx in args.context:
            lens = [ctx] if batch == 1 else rng.integers(ctx * 3 // 4, ctx + 1, batch).tolist()
            cases.append(make_case(f"decode b{batch} ctx{ctx}", lens, [], dtype, seed=batch + ctx))
    if not args.decode_only:
        dec = rng.integers(144, 193, 63).tolist()  # SmolLM2's bench: 128-token prompts, 64 out
        cases += [
            make_case("mixed 63 dec + p128", dec, [(0, 128)], dtype, 1),
            make_case("mixed 63 dec + c64@512", dec, [(512, 64)], dtype, 2),
            make_case("prefill 1 x p128", [], [(0, 128)], dtype, 3),
            make_case("prefill 4 x p128", [], [(0, 128)] * 4, dtype, 4),
            make_case("prefill c512@1024", [], [(1024, 512)], dtype, 5),
        ]
    return cases


# -- the variants -----------------------------------------------------------------


def reference_variant(case: Case) -> Callable[[], torch.Tensor]:
    """What the torch backend runs per layer (the per-step plan is made once, outside)."""
    meta, n = case.meta, case.meta.num_actual_tokens
    meta.decode_buckets = plan_decode_buckets(
        meta.seq_lens_cpu[: meta.num_decodes], meta.block_table[: meta.num_decodes], BLOCK
    )
    q, k, v = (x.view(n, -1, DIM) for x in (case.q, case.k, case.v))

    def run() -> torch.Tensor:
        write_kv_cache(k, v, case.kv_cache, meta.slot_mapping)
        return reference_attention(q, k, v, case.kv_cache, meta, SCALE).view(n, -1)

    return run


def kernel_variant(case: Case) -> Callable[[], torch.Tensor]:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the CPU kernels do not build here"
    kernel = kernels.attention
    out = torch.empty(case.q.shape, dtype=case.q.dtype)
    step = cpu_step_args(case.meta)

    def run() -> torch.Tensor:
        kernel(out, case.q, case.k, case.v, case.kv_cache, step, SCALE)
        return out

    return run


@dataclass
class GatherPlan:
    """A decode step's whole-block gather: block ids [batch * blocks] and an
    additive mask [batch, blocks * block_size] (-inf past each length)."""

    block_ids: torch.Tensor
    bias: torch.Tensor
    keys: int

    @classmethod
    def build(cls, meta: AttentionMetadata, dtype: torch.dtype) -> GatherPlan:
        keys = meta.block_table.shape[1] * BLOCK
        lens = torch.from_numpy(meta.seq_lens_cpu).long()
        bias = torch.zeros(len(lens), keys, dtype=dtype)
        bias.masked_fill_(torch.arange(keys)[None, :] >= lens[:, None], float("-inf"))
        return cls(meta.block_table.reshape(-1).long(), bias, keys)

    def gather(self, kv_cache: torch.Tensor, n: int) -> torch.Tensor:
        """[2, kv_heads, n, keys, dim]: keys and values in one index_select."""
        picked = kv_cache.view(2 * KV_HEADS, -1, BLOCK, DIM).index_select(1, self.block_ids)
        return picked.view(2, KV_HEADS, n, self.keys, DIM)


def gather_bmm_variant(case: Case) -> Callable[[], torch.Tensor]:
    n, plan = case.meta.num_actual_tokens, GatherPlan.build(case.meta, case.q.dtype)
    k, v = (x.view(n, KV_HEADS, DIM) for x in (case.k, case.v))

    def run() -> torch.Tensor:
        write_kv_cache(k, v, case.kv_cache, case.meta.slot_mapping)
        kv = plan.gather(case.kv_cache, n).view(2, KV_HEADS * n, plan.keys, DIM)
        q = case.q.view(n, KV_HEADS, GROUP, DIM).transpose(0, 1).reshape(KV_HEADS * n, GROUP, DIM)
        scores = torch.bmm(q, kv[0].transpose(1, 2)).view(KV_HEADS, n, GROUP, plan.keys)
        scores = scores.mul_(SCALE).add_(plan.bias[None, :, None, :])
        out = torch.bmm(scores.softmax(-1).view(KV_HEADS * n, GROUP, plan.keys), kv[1])
        return out.view(KV_HEADS, n, GROUP, DIM).transpose(0, 1).reshape(n, HEADS * DIM)

    return run


def gather_sdpa_variant(case: Case) -> Callable[[], torch.Tensor]:
    n, plan = case.meta.num_actual_tokens, GatherPlan.build(case.meta, case.q.dtype)
    k, v = (x.view(n, KV_HEADS, DIM) for x in (case.k, case.v))
    mask = plan.bias[:, None, None, :]

    def run() -> torch.Tensor:
        write_kv_cache(k, v, case.kv_cache, case.meta.slot_mapping)
        kv = plan.gather(case.kv_cache, n).transpose(1, 2)  # [2, n, kv_heads, keys, dim]
        q = case.q.view(n, KV_HEADS, GROUP, DIM)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=SCALE)
        return out.reshape(n, HEADS * DIM)

    return run


def fused_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Decode attention with the gather inside the arithmetic (for
    ``torch.compile``): q [n, kv_heads, group, dim], keys/values [kv_heads,
    blocks, block_size, dim], block_table [n, blocks] int64."""
    n, num_blocks = block_table.shape
    pos = torch.arange(num_blocks * BLOCK, device=q.device)
    slots = block_table[:, pos // BLOCK], pos % BLOCK  # [n, keys] each
    k = keys[:, slots[0], slots[1]].float()  # [kv_heads, n, keys, dim]
    v = values[:, slots[0], slots[1]].float()
    qf = q.transpose(0, 1).float() * SCALE  # [kv_heads, n, group, dim]
    scores = (qf.unsqueeze(3) * k.unsqueeze(2)).sum(-1)  # [kv_heads, n, group, keys]
    masked = (pos[None, :] >= seq_lens[:, None])[None, :, None, :]
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    out = (probs.unsqueeze(-1) * v.unsqueeze(2)).sum(3)  # [kv_heads, n, group, dim]
    return out.transpose(0, 1).reshape(n, HEADS * DIM).to(q.dtype)


_compiled_decode: Any = None


def compiled_variant(case: Case) -> tuple[Callable[[], torch.Tensor], float]:
    """(the variant, seconds of its first call: compilation)."""
    global _compiled_decode
    if _compiled_decode is None:
        _compiled_decode = torch.compile(fused_decode, dynamic=True)
    n = case.meta.num_actual_tokens
    k, v = (x.view(n, KV_HEADS, DIM) for x in (case.k, case.v))
    table, lens = case.meta.block_table.long(), case.meta.seq_lens.long()
    q = case.q.view(n, KV_HEADS, GROUP, DIM)

    def run() -> torch.Tensor:
        write_kv_cache(k, v, case.kv_cache, case.meta.slot_mapping)
        out: torch.Tensor = _compiled_decode(q, case.kv_cache[0], case.kv_cache[1], table, lens)
        return out

    t0 = time.perf_counter()
    run()
    return run, time.perf_counter() - t0


# -- timing -------------------------------------------------------------------------


def best_us(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def float64_reference(case: Case) -> torch.Tensor:
    meta, n = case.meta, case.meta.num_actual_tokens
    cache = case.kv_cache.double()
    q, k, v = (x.double().reshape(n, -1, DIM) for x in (case.q, case.k, case.v))
    write_kv_cache(k, v, cache, meta.slot_mapping)
    meta.decode_buckets = plan_decode_buckets(
        meta.seq_lens_cpu[: meta.num_decodes], meta.block_table[: meta.num_decodes], BLOCK
    )
    return reference_attention(q, k, v, cache, meta, SCALE).view(n, -1)


def plan_us(case: Case) -> dict[str, float]:
    """Per-step host cost of each backend's metadata (shared by the layers)."""
    meta = case.meta
    n = meta.num_decodes

    def reference_plan() -> Any:
        return plan_decode_buckets(meta.seq_lens_cpu[:n], meta.block_table[:n], BLOCK)

    def kernel_args() -> Any:
        meta.kernel_args = None
        return cpu_step_args(meta)

    return {
        "reference_plan_us": best_us(reference_plan, 20),
        "kernel_args_us": best_us(kernel_args, 20),
    }


def run_case(case: Case, args: argparse.Namespace, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    expected = float64_reference(case)
    variants = {"reference": reference_variant(case), "kernel": kernel_variant(case)}
    row: dict[str, Any] = {"case": case.name, "dtype": str(case.q.dtype)[6:], "threads": threads}
    if args.alternatives and case.decode_only:
        variants["gather_bmm"] = gather_bmm_variant(case)
        variants["gather_sdpa"] = gather_sdpa_variant(case)
        if args.compiled:
            variants["compiled"], row["compiled_first_call_s"] = compiled_variant(case)
    for name, fn in variants.items():
        row[f"{name}_err"] = float((fn().double() - expected).abs().max())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            times[name].append(best_us(fn, args.repeats))
    for name, runs in times.items():
        row[f"{name}_us"] = min(runs)
    row["speedup"] = row["reference_us"] / row["kernel_us"]
    row.update(plan_us(case))
    return row


@dataclass
class ModelStep:
    """A decode step of the loaded model over its own KV caches."""

    model: Any
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata

    @classmethod
    def build(cls, model: Any, batch: int, dtype: torch.dtype) -> ModelStep:
        rng = np.random.default_rng(batch)
        lens = rng.integers(129, 193, batch).tolist()
        meta = make_case("step", lens, [], dtype, seed=batch).meta
        num_blocks = int(meta.block_table.max()) + 1
        for layer in model.attention_layers():
            shape = kv_cache_shape(num_blocks, BLOCK, KV_HEADS, DIM)
            layer.kv_cache = torch.zeros(shape, dtype=dtype)
        ids = torch.from_numpy(rng.integers(3, model.config.vocab_size, batch))
        meta.positions = torch.from_numpy(meta.seq_lens_cpu - 1).long()
        return cls(model, ids, meta.positions, meta)

    def run(self, backend: str) -> torch.Tensor:
        """One step with every attention layer on ``backend`` (the kernel with
        the rotary fused in, as the runner sets it up), its per-step metadata
        (the reference's bucket plan, the kernel's arguments) made anew."""
        rotary = self.model.model.rotary if backend == "cpu" else None
        for layer in self.model.attention_layers():
            layer.backend, layer.fused_rotary = backend, rotary
        meta = self.meta
        meta.kernel_args = None
        if backend == "torch":
            meta.decode_buckets = plan_decode_buckets(meta.seq_lens_cpu, meta.block_table, BLOCK)
        logits: torch.Tensor = self.model.compute_logits(self.model(self.ids, self.positions, meta))
        return logits


def model_steps(args: argparse.Namespace, dtype_name: str) -> list[dict[str, Any]]:
    """Decode steps of SmolLM2 per batch size, both backends interleaved."""
    loaded = load_model(ModelConfig(device="cpu", dtype=dtype_name), with_tokenizer=False)
    rows = []
    for batch in args.batch:
        step = ModelStep.build(loaded.model, batch, DTYPES[dtype_name])
        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {"torch": [], "cpu": []}
            for _ in range(args.rounds):
                for backend, runs in times.items():
                    runs.append(best_us(partial(step.run, backend), args.repeats) / 1e3)
            row = {"case": f"SmolLM2 decode step b{batch}", "dtype": dtype_name, "threads": threads}
            row |= {f"{b}_step_ms": min(runs) for b, runs in times.items()}
            row["speedup"] = row["torch_step_ms"] / row["cpu_step_ms"]
            rows.append(row)
            print(
                f"{row['case']:28s} {dtype_name} t{threads}  reference {row['torch_step_ms']:7.1f}"
                f" ms  kernel {row['cpu_step_ms']:7.1f} ms  x{row['speedup']:.2f}",
                flush=True,
            )
    return rows


def format_row(row: dict[str, Any], names: list[str]) -> str:
    cells = [f"{row['case']:24s} {row['dtype']:4s} t{row['threads']}"]
    for name in names:
        if f"{name}_us" in row:
            cells.append(f"{name} {row[f'{name}_us']:9.0f} us (err {row[f'{name}_err']:.0e})")
    cells.append(f"x{row['speedup']:.1f}")
    return "  ".join(cells)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-only", action="store_true", help="skip the mixed and prompt steps")
    p.add_argument("--alternatives", action="store_true", help="also the torch formulations")
    p.add_argument("--compiled", action="store_true", help="with --alternatives: torch.compile")
    p.add_argument("--model-step", action="store_true", help="whole SmolLM2 decode steps")
    p.add_argument("--out", type=Path, help="JSON results")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    load_before = os.getloadavg()
    print(f"load average {load_before}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    names = ["reference", "kernel", "gather_bmm", "gather_sdpa", "compiled"]
    rows = []
    with torch.inference_mode(), reference_attention_backends():
        for dtype_name in args.dtype:
            if args.model_step:
                rows += model_steps(args, dtype_name)
                continue
            for case in workloads(args, DTYPES[dtype_name]):
                for threads in args.threads:
                    rows.append(run_case(case, args, threads))
                    print(format_row(rows[-1], names), flush=True)
    load_after = os.getloadavg()
    print(f"load average {load_after}")
    if args.out is not None:
        write_results(
            args.out,
            rows,
            load_average_before=load_before,
            load_average_after=load_after,
            cpu_count=os.cpu_count(),
            shape={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block_size": BLOCK},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
