"""The ASGI stack under the OpenAI server, measured without a model: the
same Starlette app served by each candidate server, driven by one raw-socket
HTTP/1.1 client process (keep-alive, pre-built requests, so that the client
costs little next to the server).

* ``json``: small POST requests answered with a small JSON body,
  ``--connections`` clients at once, each one request after another:
  requests/s and mean latency.
* ``sse``: ``--streams`` server-sent-event streams at once, each of
  ``--events`` events sent as fast as the server goes (one ``send`` per
  event, as a token stream is): events/s over all streams.
* ``drop``: a client reads the first event of an endless stream, then closes
  its socket (a FIN; ``--rst`` for a reset): milliseconds until the app's
  generator is closed (the disconnect reached the app), or ``None`` when
  it was not within a second.

Candidates: ``hypercorn-trio`` (Hypercorn's trio worker), ``anycorn-trio``
(Hypercorn's AnyIO fork on Trio), ``hypercorn-asyncio`` and
``uvicorn-asyncio`` (for reference: asyncio only), those installed. Each
server runs in a process of its own, the client in this one. Run:

    python benchmarks/studies/serve/asgi_stack.py [--servers hypercorn-trio ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

CANDIDATES = ("hypercorn-trio", "anycorn-trio", "hypercorn-asyncio", "uvicorn-asyncio")


def build_app(drops: Any) -> Any:
    """The Starlette app: ``POST /json``, ``GET /sse?n=N`` (0: endless);
    ``drops`` (a queue) gets the time at which an endless stream was closed."""
    import anyio
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def post_json(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"id": "x", "echo": body, "usage": {"total_tokens": 3}})

    async def sse(request: Request) -> StreamingResponse:
        n = int(request.query_params.get("n", "0"))

        async def events() -> Any:
            try:
                i = 0
                while n == 0 or i < n:
                    yield f'data: {{"choices":[{{"index":0,"text":"tok{i}"}}]}}\n\n'
                    i += 1
                    if n == 0:
                        await anyio.sleep(0.01)
                    elif i % 64 == 0:
                        await anyio.lowlevel.checkpoint()
                yield "data: [DONE]\n\n"
            finally:
                if n == 0:
                    drops.put(time.time())

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/json", post_json, methods=["POST"]), Route("/sse", sse)])


def run_server(name: str, port: int, ready: Any, drops: Any) -> None:
    app = build_app(drops)
    if name == "uvicorn-asyncio":
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error")
        server = uvicorn.Server(config)
        threading.Thread(target=_signal_ready, args=(port, ready), daemon=True).start()
        server.run()
        return
    module = __import__(name.split("-")[0])
    config = module.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    threading.Thread(target=_signal_ready, args=(port, ready), daemon=True).start()
    if name == "hypercorn-trio":
        import hypercorn.trio
        import trio

        trio.run(hypercorn.trio.serve, app, config)
    elif name == "hypercorn-asyncio":
        import asyncio

        import hypercorn.asyncio

        asyncio.run(hypercorn.asyncio.serve(app, config))
    else:
        import anycorn
        import anyio

        anyio.run(anycorn.serve, app, config, backend="trio")


def _signal_ready(port: int, ready: Any) -> None:
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            time.sleep(0.02)
            continue
        ready.set()
        return


class Connection:
    """One keep-alive HTTP/1.1 connection that reads whole responses."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buf += data

    def _headers(self) -> dict[str, str]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin1").split("\r\n")[1:]
        return {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}

    def request(self, raw: bytes) -> int:
        """Send one request; return the number of SSE events (or 1) in its response."""
        self.sock.sendall(raw)
        headers = self._headers()
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(self.buf) < size:
                self._fill()
            self.buf = self.buf[size:]
            return 1
        events = 0
        while True:  # chunked
            while b"\r\n" not in self.buf:
                self._fill()
            line, rest = self.buf.split(b"\r\n", 1)
            size = int(line, 16)
            while len(rest) < size + 2:
                self._fill()
                line, rest = self.buf.split(b"\r\n", 1)
            chunk, self.buf = rest[:size], rest[size + 2 :]
            if size == 0:
                return events
            events += chunk.count(b"data: ")


def json_load(port: int, connections: int, seconds: float) -> dict[str, float]:
    body = json.dumps({"prompt": "hello", "max_tokens": 16}).encode()
    raw = (
        b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    counts = [0] * connections
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    def worker(i: int) -> None:
        conn = Connection(port)
        while time.perf_counter() < stop:
            t = time.perf_counter()
            conn.request(raw)
            latencies.append(time.perf_counter() - t)
            counts[i] += 1

    start = time.perf_counter()
    _run_threads(worker, connections)
    elapsed = time.perf_counter() - start
    return {
        "requests_per_s": sum(counts) / elapsed,
        "mean_latency_ms": 1e3 * statistics.fmean(latencies),
    }


def sse_load(port: int, streams: int, events: int) -> dict[str, float]:
    raw = f"GET /sse?n={events} HTTP/1.1\r\nhost: x\r\n\r\n".encode()
    got = [0] * streams
    conns = [Connection(port) for _ in range(streams)]

    def worker(i: int) -> None:
        got[i] = conns[i].request(raw)

    start = time.perf_counter()
    _run_threads(worker, streams)
    elapsed = time.perf_counter() - start
    assert all(g == events + 1 for g in got), got
    return {"events_per_s": streams * events / elapsed}


def drop_latency(port: int, drops: Any, rst: bool) -> float | None:
    conn = Connection(port)
    conn.sock.sendall(b"GET /sse?n=0 HTTP/1.1\r\nhost: x\r\n\r\n")
    conn._headers()
    while b"data: " not in conn.buf:
        conn._fill()
    if rst:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    closed_at = time.time()
    conn.sock.close()
    try:
        return 1e3 * (drops.get(timeout=1.0) - closed_at)
    except Exception:  # queue.Empty: the app never saw it
        return None


def _run_threads(worker: Callable[[int], None], n: int) -> None:
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def installed(name: str) -> bool:
    module = {"uvicorn-asyncio": "uvicorn"}.get(name, name.split("-")[0])
    try:
        __import__(module)
    except ImportError:
        return False
    return name != "anycorn-trio" or _has("trio")


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    ready, drops = ctx.Event(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=run_server, args=(name, port, ready, drops), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise RuntimeError(f"{name} did not start")
        best: dict[str, Any] = {}
        for _ in range(args.repeats):
            row = json_load(port, args.connections, args.seconds)
            row |= sse_load(port, 1, args.events) | {
                "events_per_s_many": sse_load(port, args.streams, args.events)["events_per_s"]
            }
            for key, value in row.items():
                better = min if key.endswith("_ms") else max
                best[key] = better(best.get(key, value), value)
        best["drop_fin_ms"] = drop_latency(port, drops, rst=False)
        best["drop_rst_ms"] = drop_latency(port, drops, rst=True)
        return best
    finally:
        proc.terminate()
        proc.join(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", nargs="+", choices=CANDIDATES, default=list(CANDIDATES))
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="best of")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    print(
        f"{'server':<18} {'req/s':>8} {'lat ms':>7} {'ev/s 1':>8} "
        f"{'ev/s ' + str(args.streams):>8} {'drop ms':>8} {'rst ms':>7}"
    )
    for name in args.servers:
        if not installed(name):
            print(f"{name:<18} (not installed)")
            continue
        r = results[name] = measure(name, args)
        drop = "-" if r["drop_fin_ms"] is None else f"{r['drop_fin_ms']:.1f}"
        rst = "-" if r["drop_rst_ms"] is None else f"{r['drop_rst_ms']:.1f}"
        print(
            f"{name:<18} {r['requests_per_s']:>8.0f} {r['mean_latency_ms']:>7.2f} "
            f"{r['events_per_s']:>8.0f} {r['events_per_s_many']:>8.0f} {drop:>8} {rst:>7}",
            flush=True,
        )
    results["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
