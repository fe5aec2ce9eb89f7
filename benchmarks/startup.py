"""Cold start on the embedded model, as a new user meets it: each case a
fresh process, ``--repeats`` times (median; page cache warm after a first
untimed run), as ``vllm bench sweep startup`` does.

* ``import``: ``python -c "import asyncstep"``, process start to exit.
* ``help``: ``asyncstep --help``.
* ``generate``: ``asyncstep generate "What is the capital of France?"``,
  process start to exit, the answer printed (checked: it names Paris).
* ``serve N``: ``asyncstep serve --api-server-count N --port 0`` to its
  ``asyncstep: serving ... on URL`` line, then SIGTERM.
* ``first token``: in a running Python that has imported asyncstep,
  ``open_engine()`` to the first streamed token of that question.

Then one more ``generate`` with ``--log-json``: its start-up timeline, each
process's phases (the ``startup`` and ``core_startup`` spans) and the first
step, from the CLI process's start.

    python3 benchmarks/startup.py --out benchmarks/results/startup/startup.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

QUESTION = "What is the capital of France?"
FIRST_TOKEN = """
import time, trio, asyncstep
async def main():
    t0 = time.perf_counter()
    async with asyncstep.open_engine() as engine:
        params = asyncstep.SamplingParams(temperature=0, max_tokens=8)
        async for chunk in engine.stream([{"role": "user", "content": QUESTION}], params):
            print("FIRST", time.perf_counter() - t0, flush=True)
            break
trio.run(main)
""".replace("QUESTION", repr(QUESTION))


def timed(argv: list[str], check: Callable[[str], bool] | None = None) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    if done.returncode != 0 or (check is not None and not check(done.stdout)):
        raise RuntimeError(
            f"{argv} failed ({done.returncode}): {done.stdout[-500:]}{done.stderr[-2000:]}"
        )
    return seconds


def serve_ready(count: int) -> float:
    argv = [sys.executable, "-m", "asyncstep", "serve", "--port", "0"]
    argv += ["--api-server-count", str(count)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("asyncstep: serving"):
                return time.perf_counter() - t0
        raise RuntimeError(f"serve exited before its ready line: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def first_token() -> float:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_TOKEN], capture_output=True, text=True, timeout=300
    )
    for line in done.stdout.splitlines():
        if line.startswith("FIRST "):
            return float(line.split()[1])
    raise RuntimeError(f"no first token: {done.stderr[-2000:]}")


def timeline() -> list[dict[str, object]]:
    """The start-up spans of one ``generate`` run, from its process's start."""
    from asyncstep.logging.spans import CORE_STARTUP, STARTUP
    from asyncstep.logging.trace import load_spans

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "run.jsonl"
        timed([sys.executable, "-m", "asyncstep", "generate", QUESTION, "--log-json", str(log)])
        spans = load_spans(Path(tmp).glob("run.jsonl*"))
    startup = [s for s in spans if s.task in (STARTUP, CORE_STARTUP)]
    steps = [s for s in spans if s.task == "device" and s.name == "forward"]
    origin = min(s.ts_us for s in startup)
    rows = [
        {
            "track": s.task,
            "phase": s.name,
            "start_s": (s.ts_us - origin) / 1e6,
            "dur_s": s.dur_us / 1e6,
        }
        for s in sorted(startup, key=lambda s: s.ts_us)
    ]
    first = min(steps, key=lambda s: s.ts_us)
    rows.append(
        {
            "track": "device",
            "phase": "first step",
            "start_s": (first.ts_us - origin) / 1e6,
            "dur_s": first.dur_us / 1e6,
        }
    )
    return rows


def cases(server_counts: list[int]) -> dict[str, Callable[[], float]]:
    cli = [sys.executable, "-m", "asyncstep"]
    out: dict[str, Callable[[], float]] = {
        "import": lambda: timed([sys.executable, "-c", "import asyncstep"]),
        "help": lambda: timed([*cli, "--help"]),
        "generate": lambda: timed([*cli, "generate", QUESTION], lambda s: "Paris" in s),
        "first token": first_token,
    }
    for n in server_counts:
        out[f"serve {n}"] = functools.partial(serve_ready, n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", nargs="+", help="a subset of the cases, by name")
    ap.add_argument("--api-server-counts", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out")
    args = ap.parse_args()
    todo = cases(args.api_server_counts)
    if args.cases:
        todo = {k: v for k, v in todo.items() if k in args.cases}
    results: dict[str, dict[str, object]] = {}
    load_before = os.getloadavg()
    for name, run in todo.items():
        run()  # page cache warm, compiled kernels cached
        seconds = [run() for _ in range(args.repeats)]
        results[name] = {"median_s": statistics.median(seconds), "seconds": seconds}
        print(f"{name:12s} median {statistics.median(seconds):6.2f} s  {seconds}", flush=True)
    phases = timeline()
    print("\nstart-up timeline of one generate (s from its process's start):")
    for row in phases:
        print(f"  {row['track']:13s} {row['phase']:18s} {row['start_s']:6.2f} +{row['dur_s']:5.2f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "command": " ".join(["python3", *sys.argv]),
                    "date": datetime.now(UTC).isoformat(timespec="seconds"),
                    "commit": _commit(),
                    "cores": len(os.sched_getaffinity(0)),
                    "load_avg_before": load_before,
                    "load_avg_after": os.getloadavg(),
                    "results": results,
                    "timeline": phases,
                },
                f,
                indent=1,
            )
    return 0


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
