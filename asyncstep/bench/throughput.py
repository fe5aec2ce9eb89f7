"""``asyncstep bench throughput``: ``--num-prompts`` requests of random
prompts (lengths as :func:`asyncstep.bench.workload.workload`: fixed or
spread within ``--range-ratio`` of ``--input-len`` / ``--output-len``, else
uniform in [``--min-len``, ``--max-len``]), greedy with ``ignore_eos``, all
submitted at once to one engine after a warm-up request.

Figures: requests/s, output and total tokens/s over the run's wall time,
the engine's steps; with ``--gpu-busy`` (the default) the run is traced and
the GPU busy fraction is the union of the device spans (forward, sampling
and its copy) over the window from the first to the last, per rank, their
mean. ``--hf``: HF's static batches of ``--hf-batch`` requests, each run to
its largest output length (only the requested tokens count). The floor: a
whole run's bytes over the measured copy bandwidth.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from asyncstep.bench.args import BenchArgs
from asyncstep.bench.common import (
    bandwidth,
    bench_engine,
    configure,
    device_dtype,
    engine_summary,
    hf_options,
    log_level,
    progress,
    warm_up,
)
from asyncstep.bench.latency import kv_blocks, kv_cache_group_count
from asyncstep.bench.results import (
    Case,
    Column,
    finite,
    now,
    ratio,
)
from asyncstep.bench.workload import Request, workload
from asyncstep.config import EngineConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.logging import configure_logging
from asyncstep.logging.trace import Span, load_spans
from asyncstep.models.model_info import describe_model

Row = dict[str, Any]
COLUMNS: list[Column] = [
    ("requests", "params.num_prompts", ""),
    ("input tok", "params.input_tokens", ""),
    ("output tok", "params.output_tokens", ""),
    ("req/s", "figures.requests_per_s", ".2f"),
    ("output tok/s", "figures.output_tok_s", ".1f"),
    ("total tok/s", "figures.total_tok_s", ".1f"),
    ("wall s", "figures.wall_s", ".2f"),
    ("GPU busy", "figures.gpu_busy", ".1%"),
    ("HF output tok/s", "figures.hf_output_tok_s", ".1f"),
    ("floor output tok/s", "figures.floor_output_tok_s", ".0f"),
    ("/floor", "figures.output_tok_s_over_floor", ".2f"),
    ("/HF", "figures.output_tok_s_over_hf", ".2f"),
]


def busy_fractions(spans: Sequence[Span], first_step: int) -> dict[int, float]:
    """Per rank: the time covered by the device spans of steps from
    ``first_step`` over the window from the first start to the last end."""
    intervals: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for s in spans:
        if s.task == "device" and s.step is not None and s.step >= first_step:
            intervals[s.rank or 0].append((s.ts_us, s.end_us))
    busy = {}
    for rank, items in sorted(intervals.items()):
        items.sort()
        covered, (cur_start, cur_end) = 0, items[0]
        for start, end in items[1:]:
            if start > cur_end:
                covered += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        covered += cur_end - cur_start
        window = max(e for _, e in items) - items[0][0]
        busy[rank] = covered / window if window > 0 else 1.0
    return busy


async def ours(config: EngineConfig, requests: list[Request], rank_gpus: int | None) -> Row:
    """Every request at once; tokens/s over the wall time of the whole run."""
    counts: list[int] = []

    async with bench_engine(config, rank_gpus) as engine:

        async def one(request: Request) -> None:
            params = SamplingParams(temperature=0, max_tokens=request.output_len, ignore_eos=True)
            counts.append(len((await engine.generate(request.prompt, params)).token_ids))

        await warm_up(engine, 7919)
        await engine.wait_idle()
        first_step = engine.statistics().num_steps
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for request in requests:
                nursery.start_soon(one, request)
        wall = time.perf_counter() - start
        steps = engine.statistics().num_steps - first_step
        reads = engine.weight_reads
    asked = sum(r.output_len for r in requests)
    if sum(counts) != asked:
        raise RuntimeError(f"generated {sum(counts)} tokens, asked for {asked}")
    total = asked + sum(len(r.prompt) for r in requests)
    return {
        "wall_s": wall,
        "requests_per_s": len(requests) / wall,
        "output_tok_s": asked / wall,
        "total_tok_s": total / wall,
        "steps": steps,
        "first_step": first_step,
        "weight_reads": reads,
    }


def traced(bench: BenchArgs, config: EngineConfig, requests: list[Request]) -> Row:
    """:func:`ours`, its step-timeline spans logged for the busy fraction."""
    args = bench.args
    if not args.gpu_busy:
        return {**trio.run(ours, config, requests, args.rank_gpus), "traced": False}
    log_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="asyncstep_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    span_log = log_dir / "throughput.jsonl"
    if config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size > 1:
        parallel = msgspec.structs.replace(config.parallel, rank_log_json=str(span_log))
        config = msgspec.structs.replace(config, parallel=parallel)
    configure_logging(log_level(args), span_log, console=bool(args.verbose))
    try:
        row = trio.run(ours, config, requests, args.rank_gpus)
    finally:
        configure(args)
    # The engine core (a process of its own by default) writes FILE.core, ranks FILE.rank<N>.
    logs = [span_log, *sorted(log_dir.glob(span_log.name + ".*"))]
    try:
        busy = busy_fractions(load_spans(logs), row["first_step"])
    except ValueError as error:  # no spans were written
        progress(f"  no GPU busy fraction: {error}")
        busy = {}
    row["gpu_busy_per_rank"] = busy
    row["gpu_busy"] = statistics.mean(busy.values()) if busy else math.nan
    row["span_logs"] = [str(p) for p in logs] if args.trace_dir else None
    row["traced"] = True
    return row


def run(bench: BenchArgs) -> int:
    args = bench.args
    configure(args)
    started = now()
    base = bench.engine_config()
    arch = describe_model(base.model).arch_config
    requests = workload(
        arch.vocab_size,
        args.num_prompts,
        args.input_len,
        args.output_len,
        range_ratio=args.range_ratio,
        uniform=(args.min_len, args.max_len),
        seed=args.seed,
    )
    lengths = [len(r.prompt) + r.output_len for r in requests]
    sizing = {
        "max_num_seqs": len(requests),
        "max_model_len": max(lengths) + 16,
        "max_num_batched_tokens": max(2048, max(len(r.prompt) for r in requests)),
        "num_blocks": kv_blocks(  # + the warm-up
            [*lengths, 16], base.cache.block_size, kv_cache_group_count(arch)
        ),
    }
    config = bench.engine_config(**sizing)
    _, dtype = device_dtype(config)
    found = bandwidth(args, config)
    in_lens = [len(r.prompt) for r in requests]
    out_lens = [r.output_len for r in requests]
    key = f"n{len(requests)}_in{sum(in_lens)}_out{sum(out_lens)}_seed{args.seed}"
    hf: Row | None = None
    if args.hf or args.hf_from:
        from asyncstep.bench import hf as hf_baseline

        prompts = [r.prompt for r in requests]
        options = hf_options(args, config)
        hf = hf_baseline.throughput_run(arch, options, key, prompts, out_lens, args.hf_batch)
    mine = traced(bench, config, requests)
    progress(f"  ours {key}: {mine['output_tok_s']:.1f} output tok/s")
    figures: dict[str, float | None] = {
        k: finite(mine.get(k))
        for k in ("requests_per_s", "output_tok_s", "total_tok_s", "wall_s", "steps", "gpu_busy")
    }
    detail: dict[str, Any] = {"ours": mine}
    if hf is not None:
        detail["hf"] = hf
        figures["hf_output_tok_s"] = finite(hf.get("output_tok_s"))
        figures["hf_total_tok_s"] = finite(hf.get("total_tok_s"))
    figures["output_tok_s_over_hf"] = ratio(figures["output_tok_s"], figures.get("hf_output_tok_s"))
    if found is not None:
        from asyncstep.bench.floor import throughput_floor

        reads = mine.get("weight_reads")
        floor = throughput_floor(arch, dtype.itemsize, found, in_lens, out_lens, reads)
        detail["floor"] = floor
        figures["floor_output_tok_s"] = floor["output_tok_s"]
        figures["strict_floor_output_tok_s"] = floor["strict_output_tok_s"]
        figures["output_tok_s_over_floor"] = ratio(figures["output_tok_s"], floor["output_tok_s"])
    params = {
        "num_prompts": len(requests),
        "input_tokens": sum(in_lens),
        "output_tokens": sum(out_lens),
        "seed": args.seed,
    }
    case = Case(name=key, params=params, figures=figures, detail=detail)
    extra: dict[str, Any] = {"summary": engine_summary(config)}
    if found is not None:
        extra["bandwidth_tb_s"] = found / 1e12
    summary = ", ".join(f"{k} {v}" for k, v in extra["summary"].items())
    bench.publish(
        started,
        engine=config,
        cases=[case],
        extra=extra,
        columns=COLUMNS,
        title=f"asyncstep bench throughput: {summary}",
    )
    return 0
