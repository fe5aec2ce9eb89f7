"""Serving benchmark (as ``vllm bench serve``): one workload through
``asyncstep serve`` over HTTP (streaming ``/v1/completions``), then the
same workload through the in-process Python API (``Engine.stream``) in the
same run, so that the HTTP layer's cost reads as a ratio.

Workload: ``--num-prompts`` requests of random token ids, input and output
lengths ``--input-len`` / ``--output-len`` (each uniform within
``--range-ratio`` of it, vLLM's random dataset), greedy with ``ignore_eos``
(every request makes exactly its output length); sent at a Poisson
``--request-rate`` (``inf``: all at once, the default), at most
``--max-concurrency`` in flight. The same seed gives both runs the same
requests and arrival times.

Per request (client side): TTFT (send to first token), ITL (each gap
between chunks, over its tokens), TPOT ((E2E - TTFT) / (output - 1)),
E2E. Reported: request throughput, output and total tokens/s, mean / p50 /
p90 / p99 of each latency (ms), and goodput (requests/s meeting every
``--goodput`` SLO, e.g. ``--goodput ttft:500 tpot:50 e2el:10000``, in ms).
Over HTTP, token counts come from ``stream_options.continuous_usage_stats``.

Every other argument is an ``asyncstep serve`` engine or server flag
(``--model``, ``--load-format``, ``--max-num-seqs``, ``--tp``, ...): the
server is started with them on a free loopback port and stopped with
SIGTERM before the in-process engine is opened with the same engine flags
(one at a time: on a GPU both could not fit). ``--base-url`` uses a server
already running instead (its engine flags must then be given too, for the
in-process run; ``--skip-in-process`` leaves that run out).

    python benchmarks/serve.py --model llama-1b --load-format dummy \\
        --num-prompts 512 --input-len 512 --output-len 128 --max-concurrency 64
    # CPU smoke check:
    python benchmarks/serve.py --model tiny-llama --load-format dummy --device cpu \\
        --num-prompts 8 --input-len 16 --output-len 8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import trio

import asyncstep
from asyncstep import cli
from asyncstep.config import EngineConfig
from asyncstep.models.model_info import describe_model

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    #: Seconds after the start at which the request is sent (before the concurrency cap).
    arrival_s: float


@dataclass
class Result:
    """One request as the client saw it."""

    ttft_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class Timing:
    """Collects one request's chunk times."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.result = Result()

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.itl_s.extend([(now - self.last) / count] * count)
        self.last = now
        self.result.output_tokens += count

    def end(self) -> Result:
        self.result.e2e_s = time.perf_counter() - self.start
        return self.result


def workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        low = max(1, int(mean * (1 - args.range_ratio)))
        high = max(low, int(mean * (1 + args.range_ratio)))
        return rng.randint(low, high)

    requests, at = [], 0.0
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(10, vocab_size - 1) for _ in range(length(args.input_len))]
        requests.append(Request(prompt, length(args.output_len), at))
        if math.isfinite(args.request_rate):
            at += rng.expovariate(args.request_rate)
    return requests


async def run_workload(
    requests: list[Request], max_concurrency: int | None, send: Any
) -> dict[str, Any]:
    """Send each request at its arrival time (at most ``max_concurrency`` in
    flight); ``send(request) -> Result``. Returns the results and the wall time."""
    limit = trio.CapacityLimiter(max_concurrency or len(requests) or 1)
    results: list[Result] = [Result() for _ in requests]
    start = trio.current_time()

    async def one(i: int, request: Request) -> None:
        await trio.sleep_until(start + request.arrival_s)
        async with limit:
            try:
                results[i] = await send(request)
            except Exception as exc:  # a failed request counts as failed, not as a crash
                results[i] = Result(error=f"{type(exc).__name__}: {exc}")

    async with trio.open_nursery() as nursery:
        for i, request in enumerate(requests):
            nursery.start_soon(one, i, request)
    return {"results": results, "duration_s": trio.current_time() - start}


def http_sender(client: httpx.AsyncClient, model: str | None) -> Any:
    async def send(request: Request) -> Result:
        body: dict[str, Any] = {
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if model is not None:
            body["model"] = model
        timing, seen = Timing(), 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = msgspec.json.decode(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                usage = chunk.get("usage")
                if usage is not None:
                    timing.tokens(usage["completion_tokens"] - seen)
                    seen = usage["completion_tokens"]
        return timing.end()

    return send


def engine_sender(engine: asyncstep.Engine) -> Any:
    async def send(request: Request) -> Result:
        params = asyncstep.SamplingParams(
            max_tokens=request.output_len, temperature=0, ignore_eos=True
        )
        timing = Timing()
        async for chunk in engine.stream(request.prompt, params):
            timing.tokens(len(chunk.token_ids))
        return timing.end()

    return send


def summarize(
    run: dict[str, Any], requests: list[Request], slos: dict[str, float]
) -> dict[str, Any]:
    results: list[Result] = run["results"]
    done = [r for r in results if r.error is None]
    duration = run["duration_s"]
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": sum(r.output_tokens for r in done) / duration,
        "total_token_throughput": sum(
            r.output_tokens + len(q.prompt)
            for r, q in zip(results, requests, strict=True)
            if r.error is None
        )
        / duration,
    }
    series = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if not math.isnan(r.tpot_s)],
        "itl": [x for r in done for x in r.itl_s],
        "e2el": [r.e2e_s for r in done],
    }
    for name, values in series.items():
        ms = sorted(1e3 * v for v in values)
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else math.nan
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = percentile(ms, p)
    if slos:
        good = [r for r in done if all(1e3 * _slo_value(r, k) <= v for k, v in slos.items())]
        out["goodput"] = len(good) / duration
    return out


def _slo_value(result: Result, key: str) -> float:
    return {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2e_s}[key]


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


# -- the two runs -------------------------------------------------------------------------


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "asyncstep", "serve", *serve_args, "--port", "0"]
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
        if line.startswith("asyncstep: serving"):
            return proc, line.rsplit(" on ", 1)[1].strip()
    raise RuntimeError("asyncstep serve did not start:\n" + "".join(output))


def stop_server(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(120)


async def http_run(
    args: argparse.Namespace, requests: list[Request], serve_args: list[str], slos: dict[str, float]
) -> dict[str, Any]:
    proc = None
    url = args.base_url
    if url is None:
        proc, url = await trio.to_thread.run_sync(start_server, serve_args)
    try:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(
            base_url=url, timeout=None, limits=limits, headers=headers
        ) as client:
            send = http_sender(client, args.served_model)
            await run_workload(requests[: args.warmup], None, send)
            if args.client_processes > 1:
                run = await trio.to_thread.run_sync(client_processes, args, requests, url)
            else:
                run = await run_workload(requests, args.max_concurrency, send)
    finally:
        if proc is not None:
            code = await trio.to_thread.run_sync(stop_server, proc)
            if code != 0:
                print(f"warning: asyncstep serve exited with {code}", file=sys.stderr)
    return summarize(run, requests, slos)


class WorkerInput(msgspec.Struct):
    """What one client process is given (on its stdin)."""

    url: str
    api_key: str | None
    model: str | None
    #: Wall-clock time (``time.time()``) at which every worker starts its clock.
    start_at: float
    max_concurrency: int | None
    requests: list[Request]


class WorkerOutput(msgspec.Struct):
    results: list[Result]
    duration_s: float


def client_processes(args: argparse.Namespace, requests: list[Request], url: str) -> dict[str, Any]:
    """The HTTP workload split round-robin over ``--client-processes`` client
    processes (one Python client saturates a core first: measured on the
    H200's host at 64 streams, 98 % of a core for the client against 51 %
    for the server; ``benchmarks/results/serve/``), each with its share of
    the concurrency cap, all starting their clocks at the same instant."""
    n = args.client_processes
    cap = None if args.max_concurrency is None else math.ceil(args.max_concurrency / n)
    start_at = time.time() + 5.0  # after every worker has imported and connected
    workers = []
    for i in range(n):
        shard = WorkerInput(url, args.api_key, args.served_model, start_at, cap, requests[i::n])
        proc = subprocess.Popen(
            [sys.executable, __file__, "--client-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(shard))
        proc.stdin.close()
        workers.append(proc)
    results: list[Result] = [Result() for _ in requests]
    duration = 0.0
    for i, proc in enumerate(workers):
        assert proc.stdout is not None
        output = msgspec.json.decode(proc.stdout.read(), type=WorkerOutput)
        if proc.wait() != 0:
            raise RuntimeError(f"client process {i} exited with {proc.returncode}")
        results[i::n] = output.results
        duration = max(duration, output.duration_s)
    return {"results": results, "duration_s": duration}


async def client_worker(shard: WorkerInput) -> WorkerOutput:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"authorization": f"Bearer {shard.api_key}"} if shard.api_key else {}
    async with httpx.AsyncClient(
        base_url=shard.url, timeout=None, limits=limits, headers=headers
    ) as client:
        # Its connections opened first, as a service's keep-alive client has them.
        cap = shard.max_concurrency or len(shard.requests)
        warmup = [Request(r.prompt[:8], 1, 0.0) for r in shard.requests[:cap]]
        await run_workload(warmup, None, http_sender(client, shard.model))
        await trio.sleep(max(0.0, shard.start_at - time.time()))
        run = await run_workload(
            shard.requests, shard.max_concurrency, http_sender(client, shard.model)
        )
    return WorkerOutput(run["results"], run["duration_s"])


async def in_process_run(
    args: argparse.Namespace, requests: list[Request], config: EngineConfig, slos: dict[str, float]
) -> dict[str, Any]:
    async with asyncstep.open_engine(config=config) as engine:
        send = engine_sender(engine)
        await run_workload(requests[: args.warmup], None, send)
        run = await run_workload(requests, args.max_concurrency, send)
    return summarize(run, requests, slos)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Other arguments go to asyncstep serve."
    )
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform within this ratio"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (Poisson); inf: all at once",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    parser.add_argument(
        "--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft, tpot, e2el"
    )
    parser.add_argument("--base-url", help="a server already running (e.g. http://127.0.0.1:8000)")
    parser.add_argument(
        "--served-model", help="the model name to send (default: none, the server's)"
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="HTTP client processes sharing the workload (one saturates a core near 6k events/s)",
    )
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--out", help="write the results as JSON here")
    args, serve_args = parser.parse_known_args(argv)
    args.api_key = os.environ.get("ASYNCSTEP_API_KEY")
    return args, serve_args


def parse_slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in GOODPUT_KEYS or not value:
            raise SystemExit(f"--goodput takes KEY:MS with KEY one of {GOODPUT_KEYS}, got {item!r}")
        slos[key] = float(value)
    return slos


def print_table(results: dict[str, dict[str, Any]]) -> None:
    modes = list(results)
    keys = [k for k in results[modes[0]] if isinstance(results[modes[0]][k], float | int)]
    header = f"{'':<26}" + "".join(f"{m:>14}" for m in modes)
    if len(modes) == 2:
        header += f"{'http/in-proc':>14}"
    print(header)
    for key in keys:
        row = f"{key:<26}" + "".join(f"{results[m][key]:>14.2f}" for m in modes)
        if len(modes) == 2:
            a, b = results[modes[0]][key], results[modes[1]][key]
            row += f"{a / b:>14.3f}" if b else f"{'-':>14}"
        print(row)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--client-worker"]:
        shard = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerInput)
        sys.stdout.buffer.write(msgspec.json.encode(trio.run(client_worker, shard)))
        return 0
    args, serve_args = parse_args(argv)
    slos = parse_slos(args.goodput)
    serve_ns = cli.build_parser().parse_args(["serve", *serve_args])
    config = cli.config_from_args(serve_ns)
    vocab = describe_model(config.model).arch_config.vocab_size
    requests = workload(args, vocab)
    results: dict[str, dict[str, Any]] = {}
    if not args.skip_http:
        results["http"] = trio.run(http_run, args, requests, serve_args, slos)
    if not args.skip_in_process:
        results["in_process"] = trio.run(in_process_run, args, requests, config, slos)
    print_table(results)
    record = {
        "benchmark": "serve",
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "serve_args": serve_args,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "results": results,
    }
    if len(results) == 2:
        a, b = results["http"], results["in_process"]
        record["http_over_in_process"] = {
            k: a[k] / b[k] for k in a if isinstance(a[k], float | int) and b.get(k)
        }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(_finite(record), f, indent=1)
    failed = sum(r["failed"] for r in results.values())
    return 1 if failed else 0


def _finite(value: Any) -> Any:
    """``value`` as strict JSON takes it: infinities and NaNs as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
