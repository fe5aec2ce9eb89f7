"""``asyncstep bench serve``: a client load against ``asyncstep serve``
over HTTP (streaming ``/v1/completions``), as ``vllm bench serve``.

The server is started here (``python -m asyncstep serve`` with the engine
and server flags given, on a free loopback port; stopped with SIGTERM), or
``--base-url`` names one already running. Load: ``--num-prompts`` requests
of random token ids (lengths within ``--range-ratio`` of ``--input-len`` /
``--output-len``), greedy with ``ignore_eos``, sent at a Poisson
``--request-rate`` (inf: all at once), at most ``--max-concurrency`` in
flight, optionally split over ``--client-processes`` processes that start
their clocks together; ``--num-warmups`` requests first, not counted.

Per request (client side): TTFT (send to first token), ITL (each gap
between chunks, spread over its tokens), TPOT ((E2E - TTFT) / (output -
1)), E2E; token counts from ``stream_options.continuous_usage_stats``.
Figures: completed and failed requests, request throughput, output and
total tokens/s, mean / p50 / p90 / p99 of each latency (ms), goodput
(requests/s meeting every ``--goodput`` SLO), and the server's
prefix-cache hit rate over the run (from its ``/metrics``; per replica too
with ``--data-parallel-size``). ``--prefix-len`` / ``--num-prefixes``:
each prompt behind one of a few shared prefixes (system prompts).
``--in-process``: the same load through ``Engine.stream`` with the same engine flags, after the
server stopped. ``--cpu-usage``: CPU seconds of the server process, its
children (the engine core) and the client over the HTTP run (Linux).
The exit status is 1 when a request failed.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    import httpx

from asyncstep.bench.args import BenchArgs
from asyncstep.bench.client import (
    RequestResult,
    Run,
    client_processes,
    engine_sender,
    http_client,
    http_sender,
    run_load,
)
from asyncstep.bench.common import configure, progress
from asyncstep.bench.results import Case, Column, now, percentile
from asyncstep.bench.workload import Request, workload
from asyncstep.config import EngineConfig
from asyncstep.engine.front_end.api import open_engine
from asyncstep.engine.front_end.data_parallel import ServedEngine, open_data_parallel_engine
from asyncstep.errors import AsyncstepError
from asyncstep.models.model_info import describe_model
from asyncstep.server.config import API_KEY_ENV

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)
#: The line ``asyncstep serve`` prints once it listens.
READY = "asyncstep: serving"
COLUMNS: list[Column] = [
    ("run", "params.run", ""),
    ("done", "figures.completed", ".0f"),
    ("failed", "figures.failed", ".0f"),
    ("req/s", "figures.request_throughput", ".2f"),
    ("output tok/s", "figures.output_throughput", ".1f"),
    ("total tok/s", "figures.total_token_throughput", ".1f"),
    ("TTFT p50 ms", "figures.p50_ttft_ms", ".1f"),
    ("TTFT p99 ms", "figures.p99_ttft_ms", ".1f"),
    ("TPOT p50 ms", "figures.p50_tpot_ms", ".2f"),
    ("ITL p50 ms", "figures.p50_itl_ms", ".2f"),
    ("ITL p99 ms", "figures.p99_itl_ms", ".2f"),
    ("E2E p50 ms", "figures.p50_e2el_ms", ".1f"),
    ("goodput req/s", "figures.goodput", ".2f"),
    ("prefix hit", "figures.prefix_cache_hit_rate", ".3f"),
    ("server CPU %", "figures.server_cpu_pct", ".0f"),
    ("core CPU %", "figures.engine_core_cpu_pct", ".0f"),
    ("client CPU %", "figures.client_cpu_pct", ".0f"),
]


def summarize(
    run: Run, requests: list[Request], slos: dict[str, float]
) -> tuple[dict[str, float | None], list[str]]:
    """The figures of a run, and its first few distinct errors."""
    done = [r for r in run.results if r.error is None]
    duration = run.duration_s
    total = sum(
        r.output_tokens + len(q.prompt)
        for r, q in zip(run.results, requests, strict=True)
        if r.error is None
    )
    out: dict[str, float | None] = {
        "completed": len(done),
        "failed": len(run.results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": sum(r.output_tokens for r in done) / duration,
        "total_token_throughput": total / duration,
    }
    series = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if not math.isnan(r.tpot_s)],
        "itl": [x for r in done for x in r.itl_s],
        "e2el": [r.e2e_s for r in done],
    }
    for name, values in series.items():
        ms = [1e3 * v for v in values]
        out[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else None
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = percentile(ms, p) if ms else None
    if slos:
        good = [r for r in done if all(1e3 * _slo_value(r, k) <= v for k, v in slos.items())]
        out["goodput"] = len(good) / duration
    errors = sorted({r.error for r in run.results if r.error})[:5]
    return out, errors


def _slo_value(result: RequestResult, key: str) -> float:
    return {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2e_s}[key]


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            key = ""
        if key not in GOODPUT_KEYS:
            raise AsyncstepError(f"--goodput takes KEY:MS, KEY one of {GOODPUT_KEYS}: {item!r}")
    return slos


# -- the server -------------------------------------------------------------------------


def start_server(serve_argv: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``asyncstep serve`` with these flags on a free loopback port; its URL
    once it prints its ready line (its output goes on to stderr with
    ``ASYNCSTEP_BENCH_VERBOSE`` set)."""
    argv = [sys.executable, "-m", "asyncstep", "serve", *serve_argv, "--port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
            if os.environ.get("ASYNCSTEP_BENCH_VERBOSE"):
                sys.stderr.write(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    output = []
    while (line := lines.get(timeout=600)) is not None:
        output.append(line)
        if line.startswith(READY):
            return proc, line.rsplit(" on ", 1)[1].strip()
    proc.wait()
    raise AsyncstepError("asyncstep serve did not start: " + "".join(output[-3:]).strip())


def stop_server(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text() if (task / "children").exists() else ""
        found += [int(p) for p in text.split()]
    return found


def _client_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class CpuMeter:
    """CPU seconds of a server, its children and this client over a span."""

    def __init__(self, server_pid: int) -> None:
        self.pids = {"server": server_pid} | {
            f"engine_core_{i}": p for i, p in enumerate(children(server_pid))
        }
        self.before = self._read()
        self.start = time.perf_counter()

    def _read(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()} | {
            "client": _client_cpu()
        }

    def stop(self) -> dict[str, float | None]:
        after = self._read()
        wall = time.perf_counter() - self.start
        out: dict[str, float | None] = {"cpu_wall_s": wall}
        for name, value in after.items():
            used = value - self.before[name]
            out[f"{name}_cpu_s"] = used
            out[f"{name}_cpu_pct"] = used / wall * 100
        cores = [v for k, v in out.items() if k.startswith("engine_core_") and k.endswith("_s")]
        if cores:
            out["engine_core_cpu_pct"] = sum(c for c in cores if c is not None) / wall * 100
        return out


# -- the prefix cache, from the server's /metrics ----------------------------------------

#: ``asyncstep:prefix_cache_{hits,queries}_total`` samples: (replica or "", kind) -> value.
PrefixCounts = dict[tuple[str, str], float]


async def prefix_cache_counts(client: httpx.AsyncClient) -> PrefixCounts:
    """The server's prefix-cache hit and query counters (per replica, and
    ``all``, with data-parallel replicas); empty if it has none."""
    response = await client.get("/metrics")
    counts: PrefixCounts = {}
    if response.status_code != 200:
        return counts
    for line in response.text.splitlines():
        for kind in ("hits", "queries"):
            name = f"asyncstep:prefix_cache_{kind}_total"
            if line.startswith(name + "{"):
                labels, _, value = line[len(name) :].rpartition(" ")
                replica = labels.partition('replica="')[2].partition('"')[0]
                counts[(replica, kind)] = float(value)
    return counts


def prefix_cache_figures(before: PrefixCounts, after: PrefixCounts) -> dict[str, float | None]:
    """The prefix-cache hit rate over the run (prompt tokens found in the
    cache over those looked up), summed and, with replicas, per replica."""
    out: dict[str, float | None] = {}
    for replica in sorted({r for r, _ in after}):
        hits = after[(replica, "hits")] - before.get((replica, "hits"), 0.0)
        queries = after[(replica, "queries")] - before.get((replica, "queries"), 0.0)
        key = "prefix_cache_hit_rate" if replica in ("", "all") else f"replica_{replica}_hit_rate"
        out[key] = hits / queries if queries else None
        if replica not in ("", "all"):
            out[f"replica_{replica}_prompt_tokens"] = queries
    return out


# -- the runs ---------------------------------------------------------------------------


async def http_run(
    bench: BenchArgs, requests: list[Request], warmups: list[Request]
) -> tuple[Run, dict[str, float | None]]:
    """The load over HTTP; the CPU figures (``--cpu-usage``) or none."""
    args = bench.args
    proc = None
    url = args.base_url
    if url is None:
        proc, url = await trio.to_thread.run_sync(start_server, bench.engine_argv)
        progress(f"  asyncstep serve ready on {url}")
    api_key = os.environ.get(API_KEY_ENV)
    cpu: dict[str, float | None] = {}
    try:
        async with http_client(url, api_key) as client:
            send = http_sender(client, args.served_model)
            await run_load(warmups, None, send)
            before = await prefix_cache_counts(client)
            meter = CpuMeter(proc.pid) if proc is not None and args.cpu_usage else None
            if args.client_processes > 1:
                run = await trio.to_thread.run_sync(client_processes, args, requests, url, api_key)
            else:
                run = await run_load(requests, args.max_concurrency, send)
            if meter is not None:
                cpu = meter.stop()
            cpu |= prefix_cache_figures(before, await prefix_cache_counts(client))
    finally:
        if proc is not None:
            code = await trio.to_thread.run_sync(stop_server, proc)
            if code != 0:
                progress(f"warning: asyncstep serve exited with {code}")
    return run, cpu


async def in_process_run(
    config: EngineConfig,
    requests: list[Request],
    warmups: list[Request],
    max_concurrency: int | None,
) -> Run:
    async with contextlib.AsyncExitStack() as stack:
        engine: ServedEngine
        if config.parallel.data_parallel_size > 1 and config.parallel.data_parallel_rank is None:
            engine = await stack.enter_async_context(open_data_parallel_engine(config))
        else:
            engine = await stack.enter_async_context(open_engine(config=config))
        send = engine_sender(engine)
        await run_load(warmups, None, send)
        return await run_load(requests, max_concurrency, send)


def run(bench: BenchArgs) -> int:
    args = bench.args
    configure(args)
    started = now()
    slos = parse_slos(args.goodput)
    config = bench.engine_config()
    bench.server_config()  # a bad server flag fails here, before anything starts
    vocab = describe_model(config.model).arch_config.vocab_size
    load = workload(
        vocab,
        args.num_prompts + args.num_warmups,
        args.input_len,
        args.output_len,
        range_ratio=args.range_ratio,
        request_rate=args.request_rate,
        seed=args.seed,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
    )
    warmups, requests = load[: args.num_warmups], load[args.num_warmups :]
    first = requests[0].arrival_s if requests else 0.0
    requests = [Request(r.prompt, r.output_len, r.arrival_s - first) for r in requests]
    params = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": str(args.request_rate),
        "max_concurrency": args.max_concurrency,
        "prefix_len": args.prefix_len,
        "num_prefixes": args.num_prefixes,
    }
    cases = []
    errors: dict[str, list[str]] = {}
    http, cpu = trio.run(http_run, bench, requests, warmups)
    figures, errors["http"] = summarize(http, requests, slos)
    cases.append(Case(name="http", params={"run": "http", **params}, figures=figures | cpu))
    if args.in_process:
        own = trio.run(in_process_run, config, requests, warmups, args.max_concurrency)
        figures, errors["in_process"] = summarize(own, requests, slos)
        cases.append(
            Case(name="in_process", params={"run": "in_process", **params}, figures=figures)
        )
    extra: dict[str, Any] = {"errors": errors, "base_url": args.base_url}
    if len(cases) == 2:
        a, b = cases[0].figures, cases[1].figures
        extra["http_over_in_process"] = {
            k: v / w for k, v in a.items() if (w := b.get(k)) and v is not None
        }
    where = args.base_url or "a server started here"
    bench.publish(
        started,
        engine=config,
        cases=cases,
        extra=extra,
        columns=COLUMNS,
        title=f"asyncstep bench serve: {where}, {config.model.model or ''}",
    )
    for name, found in errors.items():
        for error in found:
            progress(f"  {name} error: {error}")
    return 1 if any(c.figures.get("failed") for c in cases) else 0
