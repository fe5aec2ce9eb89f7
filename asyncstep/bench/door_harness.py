"""A harness for attacks on ``asyncstep serve``'s door (issue 22): a real
server subprocess, a healthy stream beside each attack (its text, and the
largest gap between its chunks), the server's memory (the peak RSS of its
processes), raw HTTP/1.x exchanges, and polling with a deadline.

Standard library and httpx only (no asyncstep import: it drives whatever
``python -m asyncstep`` the environment runs). Used by ``tests/server/test_door.py``
and :mod:`asyncstep.bench.door`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

#: The largest gap between a healthy stream's chunks during one attack (CI: 2 cores).
MAX_GAP_S = 1.0
#: The most the server's processes may grow (peak RSS) per attacking request.
MAX_RSS_GROWTH_MIB = 300
#: The healthy stream: a greedy completion that runs until it is dropped.
HEALTHY = {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True, "stream": True}
#: Chunks a healthy stream reads after its attack ended (a stall shows in them).
CHUNKS_AFTER = 3


def wait_for(check: Callable[[], T], what: str, timeout_s: float = 30) -> T:
    """Poll ``check`` until it returns something true (a test polling a server)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)  # a poll interval, under a deadline


# -- the server ---------------------------------------------------------------


@dataclass
class Server:
    """An ``asyncstep serve`` subprocess, serving."""

    proc: subprocess.Popen[str]
    url: str
    output: list[str]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def pids(self) -> list[int]:
        """The server's process and its descendants (the engine core)."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            with (
                contextlib.suppress(OSError),
                open(f"/proc/{pid}/task/{pid}/children") as children,
            ):
                todo += [int(c) for c in children.read().split()]
        return found

    def log(self) -> str:
        return "".join(self.output)


@contextlib.contextmanager
def serving(
    args: Sequence[str], timeout_s: float = 180, checkout: str | None = None
) -> Iterator[Server]:
    """``python -m asyncstep serve --port 0 ARGS`` (the code of ``checkout``,
    a directory, if given) until it says where it serves; killed on leaving."""
    argv = [sys.executable, "-m", "asyncstep", "serve", "--port", "0", *args]
    env = None if checkout is None else os.environ | {"PYTHONPATH": checkout}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=checkout
    )
    lines: queue.Queue[str] = queue.Queue()
    output: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout_s
        url = None
        while url is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("the server did not start:\n" + "".join(output)) from None
            if line.startswith("asyncstep: serving"):
                url = line.split(" on ")[-1].strip()
        yield Server(proc, url, output)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


# -- memory -------------------------------------------------------------------


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class PeakRss:
    """The growth of processes' peak RSS from now (their ``VmHWM``, reset
    through ``clear_refs``; where that is not allowed, their RSS at the end)."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.before: dict[int, int] = {}
        for pid in self.pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/clear_refs", "w") as refs:
                refs.write("5")  # resets VmHWM to the current RSS
            self.before[pid] = _status_kib(pid, "VmRSS")

    def growth_mib(self) -> float:
        total = 0
        for pid, before in self.before.items():
            with contextlib.suppress(OSError):
                peak = max(_status_kib(pid, "VmHWM"), _status_kib(pid, "VmRSS"))
                total += max(0, peak - before)
        return total / 1024


# -- the healthy stream -------------------------------------------------------


@dataclass
class HealthyStream:
    """A greedy streamed completion read in a thread of its own: each
    chunk's text and arrival time; it stops reading (dropping the request)
    once ``stop_at`` chunks have come."""

    url: str
    stop_at: int = 10_000
    max_tokens: int = 1000
    texts: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> HealthyStream:
        """Start it, and wait for its first chunk."""
        threading.Thread(target=self._read, daemon=True).start()
        wait_for(lambda: self.times or self.done.is_set(), "the healthy stream's first chunk")
        self._raise()
        return self

    def finish(self, more_chunks: int = CHUNKS_AFTER, timeout_s: float = 60) -> None:
        """Read ``more_chunks`` more chunks, then drop the stream."""
        self.stop_at = len(self.times) + more_chunks
        wait_for(self.done.is_set, "the healthy stream to end", timeout_s)
        self._raise()

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def max_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0)

    def _read(self) -> None:
        body = HEALTHY | {"max_tokens": self.max_tokens}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    self.times.append(time.monotonic())
                    self.texts.append(json.loads(line[6:])["choices"][0]["text"])
                    if len(self.times) >= self.stop_at:
                        break
        except BaseException as exc:  # reported by start() / finish()
            self.error = exc
        finally:
            self.done.set()

    def _raise(self) -> None:
        if self.error is not None:
            raise AssertionError(f"the healthy stream failed: {self.error!r}")


def reference_text(url: str, chunks: int) -> str:
    """The healthy stream's text alone (its first ``chunks`` chunks)."""
    alone = HealthyStream(url, stop_at=chunks)
    alone.start()
    wait_for(alone.done.is_set, "the reference stream", timeout_s=120)
    return alone.text


@dataclass(frozen=True)
class Health:
    """How a healthy stream and the server fared beside an attack."""

    text: str
    max_gap_s: float
    rss_growth_mib: float
    attack_s: float
    #: The system's load average when the attack ended.
    load: str = ""


def beside_healthy_stream(server: Server, attack: Callable[[], T]) -> tuple[T, Health]:
    """Run ``attack`` once a healthy stream flows, then read a few more of
    its chunks: what the attack gave, and how the stream and memory fared."""
    stream = HealthyStream(server.url).start()
    memory = PeakRss(server.pids())
    began = time.monotonic()
    try:
        result = attack()
        took = time.monotonic() - began
    finally:
        stream.finish()
    health = Health(stream.text, stream.max_gap_s, memory.growth_mib(), took, load_average())
    return result, health


def assert_healthy(health: Health, reference: str, requests: int = 1) -> None:
    """The healthy stream's text agrees with its text alone (greedy: one
    is a prefix of the other), its largest chunk gap is at most
    :data:`MAX_GAP_S`, and the server grew at most :data:`MAX_RSS_GROWTH_MIB`
    per attacking request."""
    shorter, longer = sorted((health.text, reference), key=len)
    assert shorter and longer.startswith(shorter), (health, reference)
    assert health.max_gap_s <= MAX_GAP_S, f"a {health.max_gap_s:.2f} s gap: {health}"
    growth = health.rss_growth_mib
    assert growth <= MAX_RSS_GROWTH_MIB * requests, f"the server grew {growth:.0f} MiB: {health}"


# -- attacks ------------------------------------------------------------------


def slow_text(size: int) -> str:
    """About ``size`` UTF-8 bytes of text that tokenizes slowly (about one
    token per character): letters of many scripts, in a fixed order."""
    return "".join(chr(0x41 + (i * 7919) % 20000) for i in range(size // 3))


def nested(depth: int, leaf: str = "1") -> str:
    """``depth`` levels of arrays around ``leaf``, as JSON text."""
    return "[" * depth + leaf + "]" * depth


def deep_object(depth: int) -> str:
    """A JSON object ``depth`` levels deep (as a schema nests: properties)."""
    return '{"properties":' * depth + '{"type":"string"}' + "}" * depth


def with_raw(body: dict[str, Any], key: str, raw: str) -> bytes:
    """``body`` as JSON with ``key``'s value the raw JSON text ``raw``."""
    text = json.dumps(body | {key: "@RAW@"})
    return text.replace('"@RAW@"', raw, 1).encode()


def deep_bodies(depth: int, schema_depth: int) -> dict[str, tuple[str, bytes]]:
    """Bodies nested ``depth`` deep in each place a request nests (and
    schemas ``schema_depth`` deep, and one 900 deep: msgspec takes it): by
    name, (route, body)."""
    user = [{"role": "user", "content": "hi"}]
    chat = {"messages": user}

    def schema_format(depth: int) -> bytes:
        raw = '{"type":"json_schema","json_schema":{"schema":' + deep_object(depth) + "}}"
        return with_raw(chat, "response_format", raw)

    return {
        "top level array": ("/v1/completions", nested(depth).encode()),
        "top level object": ("/v1/completions", ('{"a":' * depth + "1" + "}" * depth).encode()),
        "prompt": ("/v1/completions", with_raw({}, "prompt", nested(depth))),
        "tools": (
            "/v1/chat/completions",
            with_raw(chat | {"tool_choice": "none"}, "tools", nested(depth)),
        ),
        "content parts": (
            "/v1/chat/completions",
            with_raw(
                {},
                "messages",
                '[{"role":"user","content":[{"type":"text","text":"hi",'
                '"x":' + nested(depth) + "}]}]",
            ),
        ),
        "structured_outputs": (
            "/v1/completions",
            with_raw({"prompt": "hi"}, "structured_outputs", '{"json":' + deep_object(depth) + "}"),
        ),
        "structured_outputs schema": (
            "/v1/completions",
            with_raw(
                {"prompt": "hi"}, "structured_outputs", '{"json":' + deep_object(schema_depth) + "}"
            ),
        ),
        "structured_outputs schema as text": (
            "/v1/completions",
            json.dumps(
                {"prompt": "hi", "structured_outputs": {"json": deep_object(schema_depth)}}
            ).encode(),
        ),
        "response_format schema": ("/v1/chat/completions", schema_format(schema_depth)),
        "response_format schema 900 deep": ("/v1/chat/completions", schema_format(900)),
        # (in fields the route does not know: msgspec skips them recursively)
        "tokenize": ("/tokenize", with_raw({"prompt": "hi"}, "x", nested(depth))),
        "detokenize": ("/detokenize", with_raw({"tokens": [1]}, "x", nested(depth))),
    }


def slow_body(port: int, declared: int, every_s: float, give_up_s: float) -> tuple[bytes, bool]:
    """A client sending a body of ``declared`` bytes one byte each
    ``every_s`` seconds (the wait for the server's answer paces it) until the
    server answers or ``give_up_s`` passes: the answer, and whether the
    server closed the connection."""
    headers = ["content-type: application/json", f"content-length: {declared}"]
    sock = send_request(port, "POST", "/v1/completions", b"", headers)
    deadline = time.monotonic() + give_up_s
    with sock:
        while time.monotonic() < deadline:
            try:
                sock.sendall(b" ")
            except OSError:  # closed by the server
                return b"", True
            sock.settimeout(every_s)
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return b"", True
            if not answer:
                return b"", True
            rest, closed = read_until_closed(sock, timeout_s=5)
            return answer + rest, closed
    return b"", False


# -- raw HTTP/1.x -------------------------------------------------------------


def send_request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Sequence[str] = (),
    version: str = "HTTP/1.1",
) -> socket.socket:
    """A connection with one request sent on it (``content-length`` is the
    body's unless ``headers`` give one)."""
    given = {h.split(":", 1)[0].strip().lower() for h in headers}
    lines = [f"{method} {path} {version}", *headers]
    if "host" not in given:
        lines.append("host: 127.0.0.1")
    if body and "content-length" not in given:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What comes on ``sock`` until the server closes it (True) or
    ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    got = b""
    with sock:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                part = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return got, True
            if not part:
                return got, True
            got += part
    return got, False


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.x response (0: none came)."""
    line = response.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


def json_body(response: bytes) -> Any:
    """The JSON body of a raw, whole (not chunked) HTTP/1.x response."""
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def post_json(url: str, path: str, body: bytes | dict[str, Any], **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=content, headers=headers, timeout=120, **kwargs)


def run_threads(count: int, work: Callable[[int], T]) -> list[T]:
    """``work(i)`` for each i < count, in threads of their own; their
    results in order (the first error is raised)."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def process_rss_mib(pids: Sequence[int]) -> float:
    """The processes' RSS now, together."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += _status_kib(pid, "VmRSS")
    return total / 1024


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"
