"""Issue 22's attack at full size: long prompts whose clients drop their
connections while a healthy stream runs, against ``asyncstep serve`` started
here with its defaults (the embedded SmolLM2 on the CPU unless told otherwise;
``tests/server/test_door_defaults.py`` runs it scaled down).

The healthy stream (a greedy completion, ``--healthy-tokens`` long, EOS
ignored) runs alone first, then again while ``--num-dropped`` streamed
completions of ``--prompt-len`` random token ids each are sent on raw
connections; once every one of them is taken (running or waiting) and the
healthy stream has gone on beside them for ``--chunks-beside`` chunks, their
connections are closed. Reports the healthy stream's largest gap between
chunks (and all of them), whether its text equals its text alone, the time
until every dropped request had ended, and the peak RSS growth of the
server's processes (API server and engine core) during the attack. ``--out``
writes it as JSON::

    python benchmarks/studies/serve/dropped_prompts.py --out benchmarks/results/dropped_prompts.json
    # the old budget:
    python benchmarks/studies/serve/dropped_prompts.py -- --max-num-batched-tokens 2048
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except FileNotFoundError:
        return 0


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"asyncstep:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no metric {name}")


def stream(url: str, body: dict[str, Any]) -> tuple[str, list[float]]:
    """A streamed completion's text and each chunk's arrival time."""
    texts, times = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=None) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(texts), times


def send_raw(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def wait_until(check: Any, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.05)


def attack(args: argparse.Namespace, url: str, pids: list[int]) -> dict[str, Any]:
    healthy = {
        "prompt": "Once upon a time",
        "max_tokens": args.healthy_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    alone, alone_times = stream(url, healthy)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, 49152) for _ in range(args.prompt_len)] for _ in range(args.num_dropped)
    ]
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(zip(("text", "times"), stream(url, healthy), strict=True))
    )
    base = {p: rss_bytes(p) for p in pids}
    peak = dict(base)
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.01):
            for p in pids:
                peak[p] = max(peak[p], rss_bytes(p))

    sampler = threading.Thread(target=sample)
    sampler.start()
    thread.start()
    time.sleep(0.5)  # the healthy request is taken first
    port = int(url.rsplit(":", 1)[1])
    socks = [send_raw(port, {"prompt": p, "max_tokens": 8, "stream": True}) for p in prompts]
    wait_until(
        lambda: (
            gauge(url, "num_requests_running") + gauge(url, "num_requests_waiting")
            >= 1 + args.num_dropped
        )
    )
    taken = time.monotonic()
    wait_until(lambda: time.monotonic() - taken > args.beside_s)
    for sock in socks:
        sock.close()
    dropped = time.monotonic()
    wait_until(lambda: gauge(url, "num_requests_running") <= 1)
    ended = time.monotonic() - dropped
    thread.join()
    sampling.set()
    sampler.join()
    times = result["times"]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "healthy_largest_gap_s": max(gaps),
        "healthy_gaps_s": [round(g, 3) for g in gaps],
        "healthy_alone_largest_gap_s": max(b - a for a, b in itertools.pairwise(alone_times)),
        "text_equals_alone": result["text"] == alone,
        "dropped_ended_after_s": ended,
        "peak_rss_growth_mib": {str(p): (peak[p] - base[p]) / 2**20 for p in pids},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-dropped", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--healthy-tokens", type=int, default=40)
    parser.add_argument(
        "--beside-s", type=float, default=5.0, help="seconds the long prompts run before the drop"
    )
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args, rest = parser.parse_known_args(argv)
    serve_args = [a for a in rest if a != "--"]
    server = subprocess.Popen(
        [sys.executable, "-m", "asyncstep", "serve", "--port", str(args.port), *serve_args]
    )
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_until(lambda: _healthy(url), timeout_s=300)
        pids = [server.pid, *children(server.pid)]
        figures = attack(args, url, pids)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(json.dumps(figures, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": "python " + " ".join(sys.argv),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_avg": os.getloadavg(),
            **figures,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def _healthy(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=1)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
