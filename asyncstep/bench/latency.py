"""``asyncstep bench latency``: per (batch size, input length), a batch of
random prompts (greedy, ``ignore_eos``: exactly ``--output-len`` tokens
each) submitted together to one engine, built once and reused.

Per case, over ``--num-iters`` runs (after ``--num-iters-warmup`` short
ones): the batch's end-to-end latency (mean and vLLM's percentiles), and
from client-side stream timestamps, medians over the runs of: TTFT (the
median request's), ITL (``itl_ms``: the median over requests of their
mean token gap once every request is decoding, i.e. after the last first
token, or ``itl_all_ms`` where no request has two tokens after that, as when
the last request's output comes in one chunk; ``itl_all_ms``: over
whole outputs, others' prefills included; an output that came in one chunk
has no gap to time and is left out of both).

``--hf``: HF transformers' ``generate`` first (then freed), ITL = (time of
N tokens - time of 1) / (N - 1). The floor (unless ``--no-floor``): a
decode step's bytes over the measured copy bandwidth
(:mod:`asyncstep.bench.floor`), at the mean context of the decode; the
weight bytes those the engine's model reads in a step of the batch's size
(packed copies where the step uses them).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from typing import Any

import trio

from asyncstep.bench.args import BenchArgs
from asyncstep.bench.common import (
    bandwidth,
    bench_engine,
    configure,
    device_dtype,
    engine_summary,
    hf_options,
    progress,
    warm_up,
)
from asyncstep.bench.results import (
    PERCENTILES,
    Case,
    Column,
    finite,
    median,
    now,
    percentile,
    ratio,
)
from asyncstep.bench.workload import random_prompts
from asyncstep.config import EngineConfig
from asyncstep.datatypes import SamplingParams, WeightReads
from asyncstep.engine.front_end.engine import Engine
from asyncstep.kv_cache_interface import kv_cache_groups
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.model_info import describe_model

#: Tokens per KV block the sizing counts in, and its headroom.
KV_HEADROOM = 1.1
WARMUP_TOKENS = 4
Row = dict[str, Any]

COLUMNS: list[Column] = [
    ("batch", "params.batch_size", ""),
    ("input", "params.input_len", ""),
    ("output", "params.output_len", ""),
    ("latency avg s", "figures.latency_avg_s", ".4f"),
    ("p50 s", "figures.latency_p50_s", ".4f"),
    ("p99 s", "figures.latency_p99_s", ".4f"),
    ("TTFT ms", "figures.ttft_ms", ".2f"),
    ("ITL ms", "figures.itl_ms", ".3f"),
    ("HF ITL ms", "figures.hf_itl_ms", ".3f"),
    ("floor ms", "figures.floor_ms", ".3f"),
    ("strict floor ms", "figures.strict_floor_ms", ".3f"),
    ("ITL/floor", "figures.itl_over_floor", ".2f"),
    ("ITL/HF", "figures.itl_over_hf", ".2f"),
]


def case_name(batch: int, input_len: int, output_len: int) -> str:
    return f"b{batch}_p{input_len}_o{output_len}"


def kv_blocks(token_counts: list[int], block_size: int, groups: int = 1) -> int:
    """Blocks for requests of these lengths in each of a model's ``groups``
    KV cache groups (:func:`kv_cache_group_count`), with 10 % headroom, and
    the null block a pool with a windowed group keeps back."""
    per_group = sum(-(-n // block_size) for n in token_counts)
    return math.ceil(per_group * groups * KV_HEADROOM) + 1


def kv_cache_group_count(arch: ModelArchConfig) -> int:
    """The KV cache groups of ``arch`` (:mod:`asyncstep.kv_cache_interface`):
    each holds its own blocks of every request."""
    return max(len(kv_cache_groups(arch.layer_windows)), 1)


def sizing(bench: BenchArgs, configs: list[tuple[int, int]]) -> dict[str, Any]:
    """The engine's sizing for the largest batch of the longest prompts."""
    args = bench.args
    max_batch = max(b for b, _ in configs)
    max_prompt = max(p for _, p in configs)
    max_model_len = max_prompt + args.output_len + 16
    base = bench.engine_config()
    groups = kv_cache_group_count(describe_model(base.model).arch_config)
    return {
        "max_num_seqs": max_batch,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max(2048, max_prompt),
        "num_blocks": kv_blocks([max_model_len] * max_batch, base.cache.block_size, groups),
    }


async def stream_batch(engine: Engine, prompts: list[list[int]], output_len: int) -> Row:
    """Submit every prompt at once; TTFT and token times from the client
    side (see the module's docstring)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    times: list[list[float]] = []
    start = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        stamps: list[float] = []
        async for chunk in engine.stream(prompt, params):
            stamps += [time.perf_counter()] * len(chunk.token_ids)
        if len(stamps) != output_len:
            raise RuntimeError(f"got {len(stamps)} tokens, asked for {output_len}")
        times.append(stamps)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    wall = time.perf_counter() - start
    all_started = max(t[0] for t in times)
    ttfts = [t[0] - start for t in times]
    itls_all = gaps(times)
    itls = gaps([[x for x in t if x > all_started] for t in times])
    return {
        "latency_s": wall,
        "itl_ms": median(itls or itls_all) * 1e3,
        "itl_all_ms": median(itls_all) * 1e3,
        "ttft_ms": median(ttfts) * 1e3,
        "ttft_max_ms": max(ttfts) * 1e3,
    }


def gaps(outputs: list[list[float]]) -> list[float]:
    """Each output's mean token gap, leaving out an output with fewer than
    two tokens or whose tokens all came in one chunk (no gap to time)."""
    return [(t[-1] - t[0]) / (len(t) - 1) for t in outputs if len(t) > 1 and t[-1] > t[0]]


async def ours(
    bench: BenchArgs, config: EngineConfig, configs: list[tuple[int, int]]
) -> tuple[dict[str, list[Row]], WeightReads | None]:
    """Each case's timed runs, one engine for all of them; and the weight
    bytes its steps read (the engine's report, for the floor)."""
    args = bench.args
    seeds = itertools.count(args.seed * 1000 + 1)  # fresh prompts: no prefix-cache hits
    runs: dict[str, list[Row]] = {}
    async with bench_engine(config, args.rank_gpus) as engine:
        vocab = engine.arch_config.vocab_size
        await warm_up(engine, next(seeds))
        for batch, input_len in configs:
            key = case_name(batch, input_len, args.output_len)
            for _ in range(args.num_iters_warmup):
                warm = random_prompts(vocab, [input_len] * batch, next(seeds))
                await stream_batch(engine, warm, min(WARMUP_TOKENS, args.output_len))
            runs[key] = []
            for _ in range(args.num_iters):
                await engine.wait_idle()
                prompts = random_prompts(vocab, [input_len] * batch, next(seeds))
                runs[key].append(await stream_batch(engine, prompts, args.output_len))
            itl = median([r["itl_ms"] for r in runs[key]])
            progress(f"  ours {key}: ITL {itl:.3f} ms")
        reads = engine.weight_reads
    return runs, reads


def figures(runs: list[Row]) -> dict[str, float | None]:
    """A case's figures from its runs (none for a floor-only case)."""
    if not runs:
        return {}
    walls = [r["latency_s"] for r in runs]
    out: dict[str, float | None] = {"latency_avg_s": statistics.fmean(walls)}
    for p in PERCENTILES:
        out[f"latency_p{p}_s"] = percentile(walls, p)
    for name in ("ttft_ms", "itl_ms", "itl_all_ms", "ttft_max_ms"):
        out[name] = finite(median([r[name] for r in runs]))
    return out


def run(bench: BenchArgs) -> int:
    args = bench.args
    configure(args)
    started = now()
    configs = [(b, p) for p in args.input_len for b in args.batch_size]
    config = bench.engine_config(**sizing(bench, configs))
    arch = describe_model(config.model).arch_config
    _, dtype = device_dtype(config)
    found = bandwidth(args, config)
    keys = {c: case_name(*c, args.output_len) for c in configs}
    hf: dict[str, Row | None] = {}
    runs: dict[str, list[Row]] = {}
    reads: WeightReads | None = None  # --floor-only: every weight, dense
    if not args.floor_only:
        if args.hf or args.hf_from:
            from asyncstep.bench import hf as hf_baseline

            batches = {
                keys[b, p]: random_prompts(arch.vocab_size, [p] * b, args.seed + b)
                for b, p in configs
            }
            hf = hf_baseline.latency_all(arch, hf_options(args, config), batches, args.output_len)
        runs, reads = trio.run(ours, bench, config, configs)
    cases = []
    for batch, input_len in configs:
        key = keys[batch, input_len]
        row = figures(runs.get(key, []))
        detail: dict[str, Any] = {"runs": runs.get(key, [])}
        theirs = hf.get(key)
        if theirs is not None:
            detail["hf"] = theirs
            row["hf_itl_ms"] = finite(theirs.get("itl_ms"))
            row["hf_ttft_ms"] = finite(theirs.get("ttft_ms"))
        if found is not None:
            from asyncstep.bench.floor import step_floor

            context = input_len + args.output_len / 2
            tp = config.parallel.tensor_parallel_size
            floor = step_floor(arch, dtype.itemsize, found, batch, context, tp, reads)
            detail["floor"] = floor
            row |= {k: floor[k] for k in ("floor_ms", "strict_floor_ms", "tp_floor_ms")}
            row["itl_over_floor"] = ratio(row.get("itl_ms"), floor["floor_ms"])
            row["itl_over_strict_floor"] = ratio(row.get("itl_ms"), floor["strict_floor_ms"])
            row["hf_itl_over_floor"] = ratio(row.get("hf_itl_ms"), floor["floor_ms"])
        row["itl_over_hf"] = ratio(row.get("itl_ms"), row.get("hf_itl_ms"))
        params = {"batch_size": batch, "input_len": input_len, "output_len": args.output_len}
        cases.append(Case(name=key, params=params, figures=row, detail=detail))
    extra: dict[str, Any] = {"summary": engine_summary(config)}
    if found is not None:
        extra["bandwidth_tb_s"] = found / 1e12
    if reads is not None:
        extra["weight_reads"] = reads
    if hf:
        extra["hf"] = hf_options(args, config).label
    summary = ", ".join(f"{k} {v}" for k, v in extra["summary"].items())
    bench.publish(
        started,
        engine=config,
        cases=cases,
        extra=extra,
        columns=COLUMNS,
        title=f"asyncstep bench latency: {summary}",
    )
    return 0
