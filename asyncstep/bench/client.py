"""The client side of ``asyncstep bench serve``: requests streamed over
HTTP (``/v1/completions``, token counts from ``continuous_usage_stats``) or
through ``Engine.stream``, sent at their arrival times under a concurrency
cap, each timed as the client sees it (TTFT, each gap between chunks
spread over its tokens, E2E); and the same load split over client
processes (``python -m asyncstep.bench.client --client-worker``, a shard
in msgpack on stdin, its results on stdout) that start their clocks
together.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from asyncstep.bench.workload import Request
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.front_end.data_parallel import ServedEngine
from asyncstep.errors import AsyncstepError

if TYPE_CHECKING:
    import httpx

Send = Callable[[Request], Awaitable["RequestResult"]]


@dataclass
class RequestResult:
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
        self.result = RequestResult()

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

    def end(self) -> RequestResult:
        self.result.e2e_s = time.perf_counter() - self.start
        return self.result


@dataclass
class Run:
    results: list[RequestResult]
    duration_s: float


async def run_load(requests: list[Request], max_concurrency: int | None, send: Send) -> Run:
    """Send each request at its arrival time, at most ``max_concurrency``
    in flight; a failed request counts as failed, not as a crash."""
    limit = trio.CapacityLimiter(max_concurrency or len(requests) or 1)
    results = [RequestResult() for _ in requests]
    start = trio.current_time()

    async def one(i: int, request: Request) -> None:
        await trio.sleep_until(start + request.arrival_s)
        async with limit:
            try:
                results[i] = await send(request)
            except Exception as exc:
                results[i] = RequestResult(error=f"{type(exc).__name__}: {exc}")

    async with trio.open_nursery() as nursery:
        for i, request in enumerate(requests):
            nursery.start_soon(one, i, request)
    return Run(results, trio.current_time() - start)


def http_sender(client: httpx.AsyncClient, model: str | None) -> Send:
    async def send(request: Request) -> RequestResult:
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


def engine_sender(engine: ServedEngine) -> Send:
    async def send(request: Request) -> RequestResult:
        params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
        timing = Timing()
        async for chunk in engine.stream(request.prompt, params):
            timing.tokens(len(chunk.token_ids))
        return timing.end()

    return send


def http_client(url: str, api_key: str | None) -> httpx.AsyncClient:
    try:
        import httpx
    except ImportError:
        raise AsyncstepError("asyncstep bench serve needs httpx (pip install httpx)") from None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=headers)


class WorkerInput(msgspec.Struct):
    """What one client process is given (on its stdin, msgpack)."""

    url: str
    api_key: str | None
    model: str | None
    #: Wall-clock time (``time.time()``) at which every worker starts its clock.
    start_at: float
    max_concurrency: int | None
    requests: list[Request]


class WorkerOutput(msgspec.Struct):
    results: list[RequestResult]
    duration_s: float


def client_processes(args: Any, requests: list[Request], url: str, api_key: str | None) -> Run:
    """The load split round-robin over ``--client-processes`` processes,
    each with its share of the concurrency cap, all starting their clocks
    at one instant."""
    n = args.client_processes
    cap = None if args.max_concurrency is None else math.ceil(args.max_concurrency / n)
    start_at = time.time() + 5.0  # after every worker has imported and connected
    workers = []
    for i in range(n):
        shard = WorkerInput(url, api_key, args.served_model, start_at, cap, requests[i::n])
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncstep.bench.client", "--client-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.msgpack.encode(shard))
        proc.stdin.close()
        workers.append(proc)
    results = [RequestResult() for _ in requests]
    duration = 0.0
    for i, proc in enumerate(workers):
        assert proc.stdout is not None
        data = proc.stdout.read()
        if proc.wait() != 0:
            raise RuntimeError(f"client process {i} exited with {proc.returncode}")
        output = msgspec.msgpack.decode(data, type=WorkerOutput)
        results[i::n] = output.results
        duration = max(duration, output.duration_s)
    return Run(results, duration)


async def client_worker(shard: WorkerInput) -> WorkerOutput:
    async with http_client(shard.url, shard.api_key) as client:
        send = http_sender(client, shard.model)
        # Its connections opened first, as a service's keep-alive client has them.
        cap = shard.max_concurrency or len(shard.requests)
        await run_load([Request(r.prompt[:8], 1) for r in shard.requests[:cap]], None, send)
        await trio.sleep(max(0.0, shard.start_at - time.time()))
        run = await run_load(shard.requests, shard.max_concurrency, send)
    return WorkerOutput(run.results, run.duration_s)


def _worker_main() -> int:
    shard = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerInput)
    sys.stdout.buffer.write(msgspec.msgpack.encode(trio.run(client_worker, shard)))
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["--client-worker"]:
    sys.exit(_worker_main())
