"""Where the host's CPU goes while ``benchmarks/serve.py`` streams over HTTP:
the CPU seconds of the server process (the front end: HTTP, detokenizer,
streams), of its engine-core child, and of the benchmark client, over one
HTTP-only run against a server started here.

    python benchmarks/serve_cpu.py --model llama-1b --load-format dummy \\
        -- --num-prompts 256 --input-len 256 --output-len 128 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8123)
    args, rest = parser.parse_known_args()
    engine_args = rest[: rest.index("--")] if "--" in rest else rest
    bench_args = rest[rest.index("--") + 1 :] if "--" in rest else []
    server = subprocess.Popen(
        [sys.executable, "-m", "asyncstep", "serve", "--port", str(args.port), *engine_args]
    )
    url = f"http://127.0.0.1:{args.port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    core = children(server.pid)
    before = {"server": cpu_seconds(server.pid), **{f"core{c}": cpu_seconds(c) for c in core}}
    start = time.perf_counter()
    client = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("serve.py")),
            "--base-url",
            url,
            "--skip-in-process",
            *engine_args,
            *bench_args,
        ]
    )
    client.wait()
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the client: the only child waited for
    client_cpu = usage.ru_utime + usage.ru_stime
    after = {"server": cpu_seconds(server.pid), **{f"core{c}": cpu_seconds(c) for c in core}}
    server.terminate()
    server.wait(timeout=60)
    print(f"wall {wall:.2f} s (the client's start-up included)")
    print(f"client: {client_cpu:.2f} CPU s = {client_cpu / wall * 100:.0f} % of one core")
    for name in before:
        used = after[name] - before[name]
        print(f"{name}: {used:.2f} CPU s = {used / wall * 100:.0f} % of one core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
