"""Decode benchmark of the GPU fast path: asyncstep against HF transformers
``generate`` (static KV cache, compiled on CUDA) on the same model shape (random
weights), in one run, next to the HBM floor measured on the same machine.

Modes:

* ``latency``: per (batch, prompt length), B requests of random prompts
  (greedy, ``ignore_eos``) submitted together to one engine (built once and
  reused). ITL per request = its mean gap between output tokens once every
  request is decoding (after the last request's first token), from
  client-side stream timestamps; median over requests (``itl_all_ms``: over
  whole outputs, others' prefill steps included); TTFT likewise.
  HF ITL = (generate N tokens - generate 1 token) / (N - 1).
* ``throughput``: ``--num-requests`` requests, input and output lengths each
  uniform in [``--min-len``, ``--max-len``] (seeded), all submitted at once:
  output and total tokens/s, wall time, and the GPU busy fraction from the
  runner's device events (step-timeline spans, as in ``overlap_decode.py``).
  HF: static batches of ``--hf-batch`` requests, left-padded, each run to its
  largest output length; only the requested output tokens count.
* ``floor``: the floor alone.

Every run measures the device-to-device copy bandwidth (1 GiB bf16
``dst.copy_(src)``, median of 20, read + write bytes). Floor per decode step
= (every weight byte + KV bytes read by the step) / bandwidth, with the mean
context over the decode; ``strict`` leaves out an untied input-embedding table
(only B rows of it are read). Throughput floor: the largest output length in
steps, each reading every weight, plus every request's KV reads.

Results: a table, JSON at ``--out`` (default
``benchmarks/results/bench/<mode>_<shape>_<tp>x<pp>_<UTC time>.json``), and one
row per configuration appended to ``benchmarks/results/bench/RESULTS.md``
(unless ``--no-record``). On the GPU machine:

    python benchmarks/bench.py latency --shape llama-1b --batch 1 8 32 128 --prompt-len 128 1024
    python benchmarks/bench.py latency --shape llama-8b --batch 1 32 --prompt-len 128 1024
    python benchmarks/bench.py throughput --shape llama-1b
    python benchmarks/bench.py latency --shape llama-8b --tp 2 --batch 1 32 \\
        --hf-from benchmarks/results/bench/latency_llama-8b_1x1_<time>.json
    python benchmarks/bench.py floor --shape llama-8b --batch 1 32 --prompt-len 128 1024

On the CPU (smoke test): ``python benchmarks/bench.py latency --shape tiny-llama
--device cpu --batch 1 2 --prompt-len 8 --output-len 4 --no-record``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_hf
import torch
import trio
from rank_gpus import open_engine_on_gpus

import asyncstep
from asyncstep import SamplingParams
from asyncstep.logging import configure_logging
from asyncstep.logging.trace import Span, load_spans
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import SHAPES, dummy_weight_shapes, get_shape
from asyncstep.models.model_loader import resolve_device, resolve_dtype

RESULTS_DIR = Path(__file__).parent / "results" / "bench"
BLOCK_SIZE = 16
KV_HEADROOM = 1.1
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
Row = dict[str, Any]


# -- options ------------------------------------------------------------------


def engine_opt(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``; the value parsed as JSON (ints, floats, true/false, lists)
    or Python's True/False/None, else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    python_words = {"True": True, "False": False, "None": None}
    if value in python_words:
        return key, python_words[value]
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_engine_opt(
    parser: argparse.ArgumentParser,
    help: str = "extra open_engine keyword (repeatable), e.g. engine_process=False",
) -> None:
    """``--engine-opt KEY=VALUE`` (repeatable): ``args.engine_opt`` is the list of
    (key, value) pairs from :func:`engine_opt`, to pass to ``open_engine``."""
    parser.add_argument(
        "--engine-opt",
        type=engine_opt,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=help,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("latency", "throughput", "floor"):
        p = sub.add_parser(mode)
        p.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
        p.add_argument("--device", help="default: cuda when there is one, else cpu")
        p.add_argument("--dtype", help="default: bfloat16 on CUDA, auto (float32) on the CPU")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--copy-gib", type=float, help="copy size (default 1 GiB; CPU 1/16)")
        p.add_argument("--copy-repeats", type=int, default=20)
        p.add_argument("--out", type=Path, help="JSON results (default under results/bench)")
        p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
        if mode in ("latency", "floor"):
            p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
            p.add_argument("--prompt-len", type=int, nargs="+", default=[128, 1024])
            p.add_argument("--output-len", type=int, default=128)
        if mode == "throughput":
            p.add_argument("--num-requests", type=int, default=256)
            p.add_argument("--min-len", type=int, default=100)
            p.add_argument("--max-len", type=int, default=1024)
            p.add_argument("--hf-batch", type=int, default=64)
            p.add_argument("--trace-dir", type=Path, help="keep the span logs here")
            p.add_argument(
                "--no-busy", action="store_true", help="run untraced: no GPU busy fraction"
            )
        if mode == "floor":
            p.add_argument("--tp", type=int, default=1, help="also show the floor / tp")
            p.set_defaults(pp=1)
        else:
            add_run_options(p)
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "auto"
    if args.copy_gib is None:
        args.copy_gib = 1.0 if args.device.startswith("cuda") else 1 / 16
    if args.mode != "floor" and args.hf_compile is None:
        args.hf_compile = args.device.startswith("cuda")
    return args


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options of the modes that run our engine and HF."""
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    p.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, help="default: not passed")
    p.add_argument("--no-overlap", action="store_true", help="async_scheduling=False")
    p.add_argument(
        "--rank-gpus",
        type=int,
        metavar="N",
        help="start the ranks here on N GPUs (fewer than tp x pp: stages share GPUs; "
        "see rank_gpus.py)",
    )
    add_engine_opt(p, "extra open_engine keyword (repeatable; overrides the sizing)")
    p.add_argument("--ours-repeats", type=int, default=1, help="our runs per configuration")
    p.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    p.add_argument("--hf-from", type=Path, help="quote HF figures from an earlier JSON")
    p.add_argument(
        "--hf-compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile HF's forward (default: on CUDA)",
    )
    p.add_argument("--hf-warmups", type=int, default=2, help="HF warm-ups per batch shape")
    p.add_argument("--repeats", type=int, default=3, help="HF timed runs (median)")


# -- machine and floor ----------------------------------------------------------


def machine_info(device: torch.device) -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "triton": version("triton"),
    }


def _time_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of ``dst.copy_(src)``: CUDA events on CUDA, perf_counter on the CPU."""
    if dst.device.type != "cuda":
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0
    with torch.cuda.device(dst.device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def copy_bandwidth(device: torch.device, gib: float, repeats: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` on a ``gib`` GiB bf16 tensor, read + write
    counted, median of ``repeats``."""
    numel = int(gib * 2**30) // 2
    src = torch.ones(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    _time_copy(dst, src)  # warm-up
    seconds = statistics.median(_time_copy(dst, src) for _ in range(repeats))
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * numel * 2 / seconds


def weight_bytes(arch: ModelArchConfig, itemsize: int) -> tuple[int, int]:
    """(bytes of every parameter, bytes of an untied input-embedding table or 0)."""
    shapes = dummy_weight_shapes(arch)
    total = sum(math.prod(s) for s in shapes.values()) * itemsize
    embed = 0 if arch.tie_word_embeddings else math.prod(shapes["model.embed_tokens.weight"])
    return total, embed * itemsize


def kv_bytes_per_token(arch: ModelArchConfig, itemsize: int) -> int:
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * itemsize


def step_floor(
    arch: ModelArchConfig,
    itemsize: int,
    bandwidth: float,
    batch: int,
    context: float,
    tp: int = 1,
) -> dict[str, float]:
    """Floor of one decode step of ``batch`` requests of ``context`` tokens each
    (one GPU; ``tp_floor_ms``: the bytes split evenly over ``tp`` GPUs)."""
    weights, embed = weight_bytes(arch, itemsize)
    kv = batch * context * kv_bytes_per_token(arch, itemsize)
    rows = batch * arch.hidden_size * itemsize if embed else 0
    floor_ms = (weights + kv) / bandwidth * 1e3
    return {
        "floor_ms": floor_ms,
        "strict_floor_ms": (weights - embed + rows + kv) / bandwidth * 1e3,
        "tp_floor_ms": floor_ms / tp,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "mean_context": context,
        "bandwidth_tb_s": bandwidth / 1e12,
    }


def throughput_floor(
    arch: ModelArchConfig,
    itemsize: int,
    bandwidth: float,
    in_lens: Sequence[int],
    out_lens: Sequence[int],
) -> dict[str, float]:
    """Floor of the whole run: at least max(out_lens) decode steps each read
    every weight, and each output token reads its request's context."""
    weights, embed = weight_bytes(arch, itemsize)
    contexts = sum(o * (i + o / 2) for i, o in zip(in_lens, out_lens, strict=True))
    kv = contexts * kv_bytes_per_token(arch, itemsize)
    steps = max(out_lens)
    rows = len(out_lens) * arch.hidden_size * itemsize if embed else 0
    floor_s = (steps * weights + kv) / bandwidth
    strict_s = (steps * (weights - embed + rows) + kv) / bandwidth
    return {
        "floor_s": floor_s,
        "strict_floor_s": strict_s,
        "output_tok_s": sum(out_lens) / floor_s,
        "strict_output_tok_s": sum(out_lens) / strict_s,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "bandwidth_tb_s": bandwidth / 1e12,
    }


# -- our engine -----------------------------------------------------------------


def random_prompts(vocab: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def kv_blocks(token_counts: Sequence[int]) -> int:
    """Blocks for requests of these lengths, with 10 % headroom."""
    return math.ceil(sum(-(-n // BLOCK_SIZE) for n in token_counts) * KV_HEADROOM)


def open_bench_engine(args: argparse.Namespace, **sizing: Any) -> Any:
    """Our engine on dummy weights: its own ranks, or (``--rank-gpus``) ranks
    started here on the given number of GPUs."""
    options = engine_options(args, **sizing)
    if args.rank_gpus is not None:
        return open_engine_on_gpus(args.shape, args.rank_gpus, **options)
    return asyncstep.open_engine(args.shape, **options)


def engine_options(args: argparse.Namespace, **sizing: Any) -> dict[str, Any]:
    """open_engine keywords: dummy weights, the layout, the sizing, the extras."""
    options: dict[str, Any] = {
        "load_format": "dummy",
        "device": args.device,
        "dtype": args.dtype,
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "async_scheduling": not args.no_overlap,
        "block_size": BLOCK_SIZE,
        **sizing,
    }
    if args.cudagraph_mode is not None:
        options["cudagraph_mode"] = args.cudagraph_mode
    options.update(dict(args.engine_opt))
    return options


async def warm_up_engine(engine: asyncstep.Engine, seed: int) -> None:
    prompt = random_prompts(engine.arch_config.vocab_size, [8], seed)[0]
    await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


async def stream_batch(engine: asyncstep.Engine, prompts: list[list[int]], output_len: int) -> Row:
    """Submit all prompts at once; each request's TTFT and token times from
    the client side. ITL (``itl_ms``) is the steady decode's: the median over
    requests of their mean token gap after the last request's first token
    (every request decoding, no prefill in the steps); ``itl_all_ms`` over
    each request's whole output (prefill steps of others included)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    times: list[list[float]] = []
    start = time.perf_counter()

    async def one(prompt: list[int]) -> None:
        stamps: list[float] = []
        async for chunk in engine.stream(prompt, params):
            now = time.perf_counter()
            stamps += [now] * len(chunk.token_ids)
        if len(stamps) != output_len:
            raise RuntimeError(f"got {len(stamps)} tokens, asked for {output_len}")
        times.append(stamps)

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    all_started = max(t[0] for t in times)
    ttfts = [t[0] - start for t in times]
    itls_all = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    itls = []
    for t in times:
        steady = [x for x in t if x > all_started]
        if len(steady) > 1:
            itls.append((steady[-1] - steady[0]) / (len(steady) - 1))
    return {
        "itl_ms": statistics.median(itls) * 1e3 if itls else math.nan,
        "itl_ms_min": min(itls, default=math.nan) * 1e3,
        "itl_ms_max": max(itls, default=math.nan) * 1e3,
        "itl_all_ms": statistics.median(itls_all) * 1e3 if itls_all else math.nan,
        "ttft_ms": statistics.median(ttfts) * 1e3,
        "ttft_ms_max": max(ttfts) * 1e3,
        "wall_s": time.perf_counter() - start,
    }


async def ours_latency(args: argparse.Namespace, configs: list[tuple[int, int]]) -> dict[str, Row]:
    """Our ITL and TTFT per (batch, prompt length), one engine for all of them."""
    max_batch = max(b for b, _ in configs)
    max_prompt = max(p for _, p in configs)
    max_model_len = max_prompt + args.output_len + 16
    sizing = {
        "max_num_seqs": max_batch,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": max(2048, max_prompt),
        "num_blocks": kv_blocks([max_model_len] * max_batch),
    }
    seeds = itertools.count(args.seed * 1000 + 1)  # fresh prompts: no prefix-cache hits
    results: dict[str, Row] = {}
    async with open_bench_engine(args, **sizing) as engine:
        vocab = engine.arch_config.vocab_size
        await warm_up_engine(engine, next(seeds))
        for batch, prompt_len in configs:
            key = latency_key(batch, prompt_len, args.output_len)
            # A short run of the same batch and length first (its kernels, its graphs).
            warm = random_prompts(vocab, [prompt_len] * batch, next(seeds))
            await stream_batch(engine, warm, min(4, args.output_len))
            runs = []
            for _ in range(args.ours_repeats):
                await engine.wait_idle()
                prompts = random_prompts(vocab, [prompt_len] * batch, next(seeds))
                runs.append(await stream_batch(engine, prompts, args.output_len))
            runs.sort(key=lambda r: r["itl_ms"])
            results[key] = {**runs[len(runs) // 2], "runs": runs}
            print(f"  ours {key}: ITL {results[key]['itl_ms']:.3f} ms", flush=True)
    return results


async def ours_throughput(
    args: argparse.Namespace, prompts: list[list[int]], out_lens: list[int], span_log: Path | None
) -> Row:
    """All requests at once; tokens/s over the wall time of the whole run."""
    lengths = [len(p) + o for p, o in zip(prompts, out_lens, strict=True)]
    sizing: dict[str, Any] = {
        "max_num_seqs": len(prompts),
        "max_model_len": max(lengths) + 16,
        "max_num_batched_tokens": max(2048, max(len(p) for p in prompts)),
        "num_blocks": kv_blocks([*lengths, 16]),  # + the warm-up request
    }
    if span_log is not None and args.tp * args.pp > 1:
        sizing["rank_log_json"] = str(span_log)  # the ranks write <span_log>.rank<N>
    counts: list[int] = []

    async def one(prompt: list[int], n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        counts.append(len((await engine.generate(prompt, params)).token_ids))

    async with open_bench_engine(args, **sizing) as engine:
        await warm_up_engine(engine, args.seed + 7919)
        await engine.wait_idle()
        first_step = engine.statistics().num_steps
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for prompt, n in zip(prompts, out_lens, strict=True):
                nursery.start_soon(one, prompt, n)
        wall = time.perf_counter() - start
        steps = engine.statistics().num_steps - first_step
    if sum(counts) != sum(out_lens):
        raise RuntimeError(f"generated {sum(counts)} tokens, asked for {sum(out_lens)}")
    total = sum(out_lens) + sum(len(p) for p in prompts)
    return {
        "wall_s": wall,
        "output_tok_s": sum(out_lens) / wall,
        "total_tok_s": total / wall,
        "steps": steps,
        "first_step": first_step,
    }


def busy_fractions(spans: Sequence[Span], first_step: int) -> dict[int, float]:
    """Per rank: the time covered by the device spans (forward; sampling and the
    copy of its ids) of steps from ``first_step``, over the window from the first
    start to the last end (the union of intervals, as in ``overlap_decode.py``)."""
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


def traced_throughput(
    args: argparse.Namespace, prompts: list[list[int]], out_lens: list[int]
) -> Row:
    """Our throughput run, with step-timeline spans logged for the GPU busy
    fraction (the runner records device events while tracing)."""
    if args.no_busy:
        return {**trio.run(ours_throughput, args, prompts, out_lens, None), "traced": False}
    log_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    span_log = log_dir / f"throughput_{args.shape}_{args.tp}x{args.pp}.jsonl"
    configure_logging("warning", span_log, console=False)
    try:
        ours = trio.run(ours_throughput, args, prompts, out_lens, span_log)
    finally:
        configure_logging("warning", console=False)
    # The engine core (a process of its own by default) writes FILE.core, ranks FILE.rank<N>.
    logs = [span_log, *sorted(log_dir.glob(span_log.name + ".*"))]
    try:
        busy = busy_fractions(load_spans(logs), ours["first_step"])
    except ValueError as error:  # no spans were written
        print(f"  no GPU busy fraction: {error}", file=sys.stderr)
        busy = {}
    ours["gpu_busy_per_rank"] = busy
    ours["gpu_busy"] = statistics.mean(busy.values()) if busy else math.nan
    ours["span_logs"] = [str(p) for p in logs] if args.trace_dir else None
    ours["traced"] = True
    ours["gpu_busy_from"] = "union of device spans (forward, sample_copy) over the run's window"
    return ours


# -- modes ----------------------------------------------------------------------


def hf_options(args: argparse.Namespace) -> bench_hf.HfOptions:
    device = resolve_device(args.device)
    return bench_hf.HfOptions(
        device=device,
        dtype=resolve_dtype(args.dtype, device),
        compile=args.hf_compile,
        warmups=args.hf_warmups,
        repeats=args.repeats,
        skip=args.no_hf,
        quote_from=args.hf_from,
    )


def itemsize(args: argparse.Namespace) -> int:
    return resolve_dtype(args.dtype, resolve_device(args.device)).itemsize


def latency_key(batch: int, prompt_len: int, output_len: int) -> str:
    return f"b{batch}_p{prompt_len}_o{output_len}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def run_latency(args: argparse.Namespace, arch: ModelArchConfig, bandwidth: float) -> list[Row]:
    """HF first (then freed), then our engine, over every (batch, prompt length)."""
    configs = [(b, p) for p in args.prompt_len for b in args.batch]
    keys = {c: latency_key(*c, args.output_len) for c in configs}
    batches = {
        keys[b, p]: random_prompts(arch.vocab_size, [p] * b, args.seed + b) for b, p in configs
    }
    hf = bench_hf.latency_all(arch, hf_options(args), batches, args.output_len)
    ours = trio.run(ours_latency, args, configs)
    rows = []
    for batch, prompt_len in configs:
        key = keys[batch, prompt_len]
        context = prompt_len + args.output_len / 2
        floor = step_floor(arch, itemsize(args), bandwidth, batch, context, args.tp)
        mine, theirs = ours[key]["itl_ms"], (hf[key] or {}).get("itl_ms")
        ratios = {
            "ours_itl_over_floor": ratio(mine, floor["floor_ms"]),
            "ours_itl_over_strict_floor": ratio(mine, floor["strict_floor_ms"]),
            "ours_itl_over_tp_floor": ratio(mine, floor["tp_floor_ms"]),
            "ours_itl_over_hf": ratio(mine, theirs),
            "hf_itl_over_floor": ratio(theirs, floor["floor_ms"]),
        }
        config = {"batch": batch, "prompt_len": prompt_len, "output_len": args.output_len}
        rows.append(
            {"key": key, "config": config, "ours": ours[key], "hf": hf[key]}
            | {"floor": floor, "ratios": ratios}
        )
    return rows


def run_throughput(args: argparse.Namespace, arch: ModelArchConfig, bandwidth: float) -> list[Row]:
    """HF first (then freed), then our engine, on one seeded random workload."""
    rng = random.Random(args.seed)
    n = args.num_requests
    in_lens = [rng.randint(args.min_len, args.max_len) for _ in range(n)]
    out_lens = [rng.randint(args.min_len, args.max_len) for _ in range(n)]
    prompts = random_prompts(arch.vocab_size, in_lens, args.seed + 1)
    key = f"n{n}_len{args.min_len}-{args.max_len}_seed{args.seed}"
    hf = bench_hf.throughput_run(arch, hf_options(args), key, prompts, out_lens, args.hf_batch)
    ours = traced_throughput(args, prompts, out_lens)
    print(f"  ours {key}: {ours['output_tok_s']:.1f} output tok/s", flush=True)
    floor = throughput_floor(arch, itemsize(args), bandwidth, in_lens, out_lens)
    mine, theirs = ours["output_tok_s"], (hf or {}).get("output_tok_s")
    ratios = {
        "ours_tok_s_over_floor": ratio(mine, floor["output_tok_s"]),
        "ours_tok_s_over_strict_floor": ratio(mine, floor["strict_output_tok_s"]),
        "ours_tok_s_over_hf": ratio(mine, theirs),
        "hf_tok_s_over_floor": ratio(theirs, floor["output_tok_s"]),
    }
    config = {"num_requests": n, "min_len": args.min_len, "max_len": args.max_len}
    config |= {"seed": args.seed, "input_tokens": sum(in_lens), "output_tokens": sum(out_lens)}
    return [
        {"key": key, "config": config, "ours": ours, "hf": hf, "floor": floor, "ratios": ratios}
    ]


def run_floor(args: argparse.Namespace, arch: ModelArchConfig, bandwidth: float) -> list[Row]:
    rows = []
    for prompt_len in args.prompt_len:
        for batch in args.batch:
            context = prompt_len + args.output_len / 2
            config = {"batch": batch, "prompt_len": prompt_len, "output_len": args.output_len}
            floor = step_floor(arch, itemsize(args), bandwidth, batch, context, args.tp)
            key = latency_key(batch, prompt_len, args.output_len)
            rows.append({"key": key, "config": config, "floor": floor})
    return rows


# -- output ---------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or math.isnan(value):
        return "-"
    return format(value, spec)


def _get(row: Row, path: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; None where a level is missing."""
    value: Any = row
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


#: Printed columns per mode: (header, path in the row, format; "" prints as is).
COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "latency": [
        ("batch", "config.batch", ""),
        ("prompt", "config.prompt_len", ""),
        ("ours ITL ms", "ours.itl_ms", ".3f"),
        ("ours TTFT ms", "ours.ttft_ms", ".1f"),
        ("HF ITL ms", "hf.itl_ms", ".3f"),
        ("floor ms", "floor.floor_ms", ".3f"),
        ("strict floor ms", "floor.strict_floor_ms", ".3f"),
        ("ours/floor", "ratios.ours_itl_over_floor", ".2f"),
        ("ours/HF", "ratios.ours_itl_over_hf", ".2f"),
    ],
    "throughput": [
        ("requests", "config.num_requests", ""),
        ("ours out tok/s", "ours.output_tok_s", ".0f"),
        ("ours total tok/s", "ours.total_tok_s", ".0f"),
        ("ours wall s", "ours.wall_s", ".2f"),
        ("GPU busy", "ours.gpu_busy", ".1%"),
        ("HF out tok/s", "hf.output_tok_s", ".0f"),
        ("floor out tok/s", "floor.output_tok_s", ".0f"),
        ("ours/floor", "ratios.ours_tok_s_over_floor", ".2f"),
        ("ours/HF", "ratios.ours_tok_s_over_hf", ".2f"),
    ],
    "floor": [
        ("batch", "config.batch", ""),
        ("prompt", "config.prompt_len", ""),
        ("weight bytes", "floor.weight_bytes", ".4g"),
        ("KV bytes", "floor.kv_bytes", ".4g"),
        ("floor ms", "floor.floor_ms", ".3f"),
        ("strict floor ms", "floor.strict_floor_ms", ".3f"),
    ],
}


def print_table(args: argparse.Namespace, result: Row) -> None:
    from rich.console import Console
    from rich.table import Table

    device = result["machine"]["gpu"] or "cpu"
    table = Table(title=f"{args.mode} {args.shape} on {device}: {result['options_summary']}")
    columns = COLUMNS[args.mode]
    if args.tp > 1 and args.mode != "throughput":
        columns = [*columns, (f"floor/{args.tp} ms", "floor.tp_floor_ms", ".3f")]
    for header, _, _ in columns:
        table.add_column(header, justify="right")
    for row in result["rows"]:
        cells = [_get(row, path) for _, path, _ in columns]
        table.add_row(
            *(
                str(v) if not spec else fmt(v, spec)
                for v, (_, _, spec) in zip(cells, columns, strict=True)
            )
        )
    console = Console(width=160)
    console.print(table)
    console.print(
        f"copy bandwidth {result['bandwidth_tb_s']:.3f} TB/s (read + write, {args.copy_gib:g} GiB"
        f" bf16, median of {args.copy_repeats}). Ratios are of the metric: ITL lower is better,"
        " tok/s higher is better."
    )
    if args.mode == "throughput":
        console.print(
            "HF: static batches run to their largest output length; only each request's"
            " requested output tokens count as useful."
        )


def options_summary(args: argparse.Namespace) -> str:
    if args.mode == "floor":
        return f"{args.dtype}, floor only"
    parts = [args.dtype, "overlap off" if args.no_overlap else "overlap on"]
    parts.append(f"cudagraph {args.cudagraph_mode or 'default'}")
    parts += [f"{k}={v}" for k, v in args.engine_opt]
    parts.append(f"HF {hf_options(args).label}")
    return ", ".join(parts)


RESULTS_COLUMNS = ["date (UTC)", "mode", "shape", "tp x pp", "device", "config", "metric"]
RESULTS_COLUMNS += ["ours", "HF", "floor", "strict", "ours/floor", "ours/HF", "options", "json"]
RESULTS_HEADER = f"""# bench.py results

One row per configuration of `benchmarks/bench.py` (appended by each run unless
`--no-record`; the JSON file holds the command, the machine and every figure).

- **config**: latency `bB pP oO` (batch, prompt length, output length);
  throughput `nN lenA-B` (requests; input and output lengths uniform in [A, B]).
- **metric**: latency: median ITL over requests (ms; ours from client-side
  stream timestamps, HF: (generate N tokens - generate 1) / (N - 1));
  throughput: output tokens/s (HF: only the requested output tokens of its
  static batches count).
- **floor**: the HBM floor: (every weight byte + KV bytes read) / measured
  copy bandwidth; per decode step at the mean context (latency), or as output
  tokens/s of the whole run (throughput). **strict**: without an untied
  input-embedding table (only B rows of it are read).
- **ours/floor**, **ours/HF**: ratios of the metric (ITL: lower is better;
  tok/s: higher is better).

| {" | ".join(RESULTS_COLUMNS)} |
|{"---|" * len(RESULTS_COLUMNS)}
"""


def results_md_rows(args: argparse.Namespace, result: Row, json_path: Path) -> list[str]:
    lines = []
    for r in result["rows"]:
        c = r["config"]
        if args.mode == "latency":
            config, metric = f"b{c['batch']} p{c['prompt_len']} o{c['output_len']}", "itl_ms"
            floors = ("floor.floor_ms", "floor.strict_floor_ms")
            ratios = ("ratios.ours_itl_over_floor", "ratios.ours_itl_over_hf")
        else:
            config, metric = (
                f"n{c['num_requests']} len{c['min_len']}-{c['max_len']}",
                "output_tok_s",
            )
            floors = ("floor.output_tok_s", "floor.strict_output_tok_s")
            ratios = ("ratios.ours_tok_s_over_floor", "ratios.ours_tok_s_over_hf")
        paths = [f"ours.{metric}", f"hf.{metric}", *floors, *ratios]
        cells = [result["date"], args.mode, args.shape, f"{args.tp}x{args.pp}"]
        cells += [result["machine"]["gpu"] or "cpu", config, metric]
        cells += [fmt(_get(r, p)) for p in paths]
        cells += [result["options_summary"], str(json_path)]
        lines.append("| " + " | ".join(cells) + " |\n")
    return lines


def record_results(args: argparse.Namespace, result: Row, json_path: Path) -> Path:
    path = RESULTS_DIR / "RESULTS.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(RESULTS_HEADER)
    repo = Path(__file__).resolve().parent.parent
    shown = json_path.resolve()
    if shown.is_relative_to(repo):
        shown = shown.relative_to(repo)
    with path.open("a") as f:
        f.writelines(results_md_rows(args, result, shown))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    arch = get_shape(args.shape)
    device = resolve_device(args.device)
    started = datetime.now(UTC)
    bandwidth = copy_bandwidth(device, args.copy_gib, args.copy_repeats)
    print(f"copy bandwidth on {device}: {bandwidth / 1e12:.3f} TB/s", flush=True)
    run = {"latency": run_latency, "throughput": run_throughput, "floor": run_floor}[args.mode]
    rows = run(args, arch, bandwidth)
    result: Row = {
        "command": sys.argv,
        "python": sys.executable,
        "date": started.isoformat(timespec="seconds"),
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "mode": args.mode,
        "shape": args.shape,
        "options": vars(args),
        "options_summary": options_summary(args),
        "bandwidth_tb_s": bandwidth / 1e12,
        "rows": rows,
    }
    out = args.out
    if out is None:
        stamp = started.strftime("%Y%m%dT%H%M%SZ")
        out = RESULTS_DIR / f"{args.mode}_{args.shape}_{args.tp}x{args.pp}_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(args, result)
    print(f"wrote {out}")
    if not args.no_record and args.mode != "floor":
        print(f"appended to {record_results(args, result, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
