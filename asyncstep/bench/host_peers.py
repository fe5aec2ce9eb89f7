"""The two systems :mod:`~asyncstep.bench.host_cpu` compares, each run on
the same prompts: HF transformers ``generate`` (:func:`hf_run`: one
left-padded batch) and asyncstep (:func:`ours_run`: rounds of every request
at once through :func:`one_round`, by variant: generate or stream, with or
without a :class:`BusyCaller` holding the caller's loop), on the
``tiny-llama`` shape (:data:`SHAPE`) with dummy fp32 weights on the CPU.

Imports torch, anyio, asyncstep's public API, :mod:`asyncstep.bench.hf`,
:mod:`asyncstep.bench.latency`'s KV sizing and :mod:`asyncstep.bench.host_load`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import torch

import asyncstep
from asyncstep import SamplingParams
from asyncstep.bench import hf as bench_hf
from asyncstep.bench.host_load import cpu_seconds, other_load
from asyncstep.bench.latency import kv_blocks
from asyncstep.models.config import ModelArchConfig

__all__ = [
    "BLOCK_SIZE",
    "SHAPE",
    "BusyCaller",
    "Row",
    "engine_options",
    "hf_run",
    "one_round",
    "ours_run",
    "tok_s",
    "variants",
]

SHAPE = "tiny-llama"
BLOCK_SIZE = 16
Row = dict[str, Any]


def tok_s(rounds: Sequence[float], tokens: int) -> float:
    return tokens / statistics.median(rounds)


# -- HF -------------------------------------------------------------------------


def hf_run(arch: ModelArchConfig, prompts: list[list[int]], output_len: int, repeats: int) -> Row:
    """One left-padded batch of every prompt through ``generate``: a warm-up
    run, then ``repeats`` timed runs; tok/s of the median."""
    options = bench_hf.HfOptions(
        device=torch.device("cpu"), dtype=torch.float32, compile=False, warmups=1, repeats=repeats
    )
    ids, mask = bench_hf.left_pad(prompts, max(len(p) for p in prompts), options.device)

    def work(model: Any) -> list[float]:
        bench_hf.timed_generate(model, ids, mask, output_len, output_len)  # warm-up
        return [
            bench_hf.timed_generate(model, ids, mask, output_len, output_len)
            for _ in range(repeats)
        ]

    seconds = bench_hf.with_model(arch, options, work)
    return {
        "tok_s": tok_s(seconds, len(prompts) * output_len),
        "seconds": seconds,
        "batch": list(ids.shape),
        "source": options.label,
    }


# -- our engine -----------------------------------------------------------------


def engine_options(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """open_engine keywords: dummy weights on the CPU in fp32, room for every
    request at once, the prompts in about two steps; then ``--engine-opt``."""
    total = sum(len(p) for p in prompts)
    lengths = [len(p) + args.output_len for p in prompts]
    warm = [len(p) + args.output_len for p in prompts[: args.warmup_requests]]
    options: dict[str, Any] = {
        "load_format": "dummy",
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": len(prompts),
        "max_num_batched_tokens": max(-(-total // 2), max(len(p) for p in prompts), 256),
        "max_model_len": max(lengths) + BLOCK_SIZE,
        "block_size": BLOCK_SIZE,
        "num_blocks": kv_blocks([*lengths, *warm], BLOCK_SIZE),
        "enable_prefix_caching": False,
    }
    options.update(dict(args.engine_opt))
    return options


class BusyCaller:
    """A task of the caller's loop that holds it ``hold_s`` at a time."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.holds = 0
        self.held_s = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            end = start + self.hold_s
            while time.perf_counter() < end:
                pass
            self.holds += 1
            self.held_s += time.perf_counter() - start
            await anyio.lowlevel.checkpoint()  # = trio.sleep(0), asyncio.sleep(0)


async def one_round(
    engine: asyncstep.Engine,
    prompts: list[list[int]],
    output_len: int,
    *,
    stream: bool = False,
    busy_s: float = 0.0,
) -> Row:
    """Every request at once (generate, or stream reading every chunk), with
    the busy caller when ``busy_s``; the round's seconds and counts."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    tokens: list[int] = []
    chunks: list[int] = []

    async def one(prompt: list[int]) -> None:
        if stream:
            n = k = 0
            async for chunk in engine.stream(prompt, params):
                n += len(chunk.token_ids)
                k += 1
            tokens.append(n)
            chunks.append(k)
        else:
            tokens.append(len((await engine.generate(prompt, params)).token_ids))

    await engine.wait_idle()
    cpu_start = cpu_seconds()
    busy = BusyCaller(busy_s)
    async with anyio.create_task_group() as outer:
        if busy_s > 0:
            outer.start_soon(busy.run)
        start = time.perf_counter()
        async with anyio.create_task_group() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
        seconds = time.perf_counter() - start
        outer.cancel_scope.cancel()
    if tokens != [output_len] * len(prompts):
        raise RuntimeError(f"generated {sum(tokens)} tokens, asked for {output_len * len(prompts)}")
    row: Row = {
        "seconds": seconds,
        "other_cores": other_load(cpu_start, seconds).get("other_cores"),
    }
    if stream:
        row["chunks"] = sum(chunks)
    if busy_s > 0:
        row["holds"] = busy.holds
        row["held_fraction"] = busy.held_s / seconds
    return row


def variants(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The timed variants: name -> one_round keywords."""
    out: dict[str, dict[str, Any]] = {"generate": {}}
    if args.streams:
        out["stream"] = {"stream": True}
    if args.busy_ms > 0:
        busy = {"busy_s": args.busy_ms / 1e3}
        out["busy_generate"] = busy
        if args.streams and args.busy_streams:
            out["busy_stream"] = {"stream": True, **busy}
    return out


async def ours_run(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Row]:
    """A warm-up round, then ``--repeats`` rounds of every variant (interleaved)."""
    tokens = len(prompts) * args.output_len
    runs: dict[str, list[Row]] = defaultdict(list)
    async with asyncstep.open_engine(SHAPE, **engine_options(args, prompts)) as engine:
        warm = prompts[: args.warmup_requests]
        await one_round(engine, warm, args.output_len)
        if args.streams:
            await one_round(engine, warm, args.output_len, stream=True)
        for i in range(args.repeats):
            for name, kw in variants(args).items():
                if "busy_s" in kw and i >= args.busy_repeats:
                    continue
                runs[name].append(await one_round(engine, prompts, args.output_len, **kw))
    results: dict[str, Row] = {}
    for name, rows in runs.items():
        seconds = [r["seconds"] for r in rows]
        results[name] = {"tok_s": tok_s(seconds, tokens), "seconds": seconds, "rounds": rows}
        print(f"  ours {name}: {results[name]['tok_s']:.0f} tok/s", flush=True)
    return results
