"""``asyncstep bench startup``: cold start as a new user meets it, each case
a fresh process, ``--repeats`` times after one untimed run (page cache
warm, compiled kernels cached); the median and the spread.

* ``import``: ``python -c "import asyncstep"``, process start to exit.
* ``help``: ``asyncstep --help``.
* ``generate``: ``asyncstep generate QUESTION``, start to exit, the answer
  printed (checked to name Paris when no engine flag is given).
* ``serve-N``: ``asyncstep serve --api-server-count N --port 0`` to its
  ``asyncstep: serving ... on URL`` line, then SIGTERM.
* ``first-token``: in a Python that has imported asyncstep,
  ``open_engine()`` to the first streamed token.

The engine flags given go to generate, serve and open_engine (a model
without a tokenizer, e.g. ``--load-format dummy --model llama-8b``, gets a
prompt of token ids). Then (``--timeline``) one more ``generate`` with
``--log-json``: each process's start-up spans and the first step, from the
CLI process's start.
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from asyncstep.bench.args import BenchArgs
from asyncstep.bench.common import configure, progress
from asyncstep.bench.results import Case, Column, now
from asyncstep.errors import AsyncstepError
from asyncstep.models.model_info import describe_model

QUESTION = "What is the capital of France?"
#: The prompt of a model without a tokenizer.
TOKEN_IDS = list(range(3, 35))
CONFIG_ENV = "ASYNCSTEP_BENCH_CONFIG"
FIRST_TOKEN = """
import os, time, trio, asyncstep
from asyncstep.config import decode_config
async def main():
    t0 = time.perf_counter()
    config = decode_config(bytes.fromhex(os.environ[CONFIG_ENV]))
    async with asyncstep.open_engine(config=config) as engine:
        params = asyncstep.SamplingParams(temperature=0, max_tokens=8)
        async for chunk in engine.stream(PROMPT, params):
            print("FIRST", time.perf_counter() - t0, flush=True)
            break
trio.run(main)
"""
CASES = ("import", "help", "generate", "first-token")
COLUMNS: list[Column] = [
    ("case", "params.case", ""),
    ("median s", "figures.median_s", ".3f"),
    ("min s", "figures.min_s", ".3f"),
    ("max s", "figures.max_s", ".3f"),
]
TIMEOUT_S = 600


def timed(argv: list[str], check: Callable[[str], bool] | None = None) -> float:
    """Seconds from starting ``argv`` to its exit (it must succeed, and its
    stdout pass ``check``)."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    seconds = time.perf_counter() - t0
    if done.returncode != 0 or (check is not None and not check(done.stdout)):
        raise AsyncstepError(
            f"{' '.join(argv[1:4])} ... failed ({done.returncode}): "
            f"{(done.stdout[-200:] + done.stderr[-500:]).strip()}"
        )
    return seconds


def serve_ready(count: int, engine_argv: list[str]) -> float:
    """Seconds from starting ``asyncstep serve`` to its ready line."""
    argv = [sys.executable, "-m", "asyncstep", "serve", *engine_argv, "--port", "0"]
    argv += ["--api-server-count", str(count)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("asyncstep: serving"):
                return time.perf_counter() - t0
        raise AsyncstepError(f"serve exited before its ready line: {proc.stderr.read()[-500:]}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def first_token(config_hex: str, prompt: Any) -> float:
    code = FIRST_TOKEN.replace("CONFIG_ENV", repr(CONFIG_ENV)).replace("PROMPT", repr(prompt))
    env = os.environ | {CONFIG_ENV: config_hex}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    for line in done.stdout.splitlines():
        if line.startswith("FIRST "):
            return float(line.split()[1])
    raise AsyncstepError(f"first-token: no first token: {done.stderr[-500:].strip()}")


def generate_argv(engine_argv: list[str], tokenizer: bool) -> list[str]:
    argv = [sys.executable, "-m", "asyncstep", "generate", *engine_argv]
    if tokenizer:
        return [*argv, QUESTION]
    return [*argv, "--max-tokens", "8", "--token-ids", " ".join(map(str, TOKEN_IDS))]


def timeline(generate: list[str]) -> list[dict[str, Any]]:
    """The start-up spans of one ``generate`` run, from its process's start."""
    from asyncstep.logging.spans import CORE_STARTUP, STARTUP
    from asyncstep.logging.trace import load_spans

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "run.jsonl"
        timed([*generate, "--log-json", str(log)])
        spans = load_spans(Path(tmp).glob("run.jsonl*"))
    startup = [s for s in spans if s.task in (STARTUP, CORE_STARTUP)]
    if not startup:
        return []
    origin = min(s.ts_us for s in startup)
    rows: list[dict[str, Any]] = [
        {
            "track": s.task,
            "phase": s.name,
            "start_s": (s.ts_us - origin) / 1e6,
            "dur_s": s.dur_us / 1e6,
        }
        for s in sorted(startup, key=lambda s: s.ts_us)
    ]
    steps = [s for s in spans if s.task == "device" and s.name == "forward"]
    if steps:
        first = min(steps, key=lambda s: s.ts_us)
        start = (first.ts_us - origin) / 1e6
        rows.append(
            {
                "track": "device",
                "phase": "first step",
                "start_s": start,
                "dur_s": first.dur_us / 1e6,
            }
        )
    return rows


def cases(bench: BenchArgs) -> dict[str, Callable[[], float]]:
    """Each case's timed run, by name, in order."""
    args = bench.args
    config = bench.engine_config()
    tokenizer = describe_model(config.model).tokenizer is not None
    engine_argv = bench.engine_argv
    cli = [sys.executable, "-m", "asyncstep"]
    check = (lambda s: "Paris" in s) if not engine_argv else None
    prompt: Any = [{"role": "user", "content": QUESTION}] if tokenizer else TOKEN_IDS
    config_hex = msgspec.msgpack.encode(config).hex()
    out: dict[str, Callable[[], float]] = {
        "import": lambda: timed([sys.executable, "-c", "import asyncstep"]),
        "help": lambda: timed([*cli, "--help"]),
        "generate": lambda: timed(generate_argv(engine_argv, tokenizer), check),
        "first-token": functools.partial(first_token, config_hex, prompt),
    }
    for n in args.api_server_counts:
        out[f"serve-{n}"] = functools.partial(serve_ready, n, engine_argv)
    if args.cases:
        unknown = set(args.cases) - out.keys()
        if unknown:
            raise AsyncstepError(
                f"--cases: unknown {', '.join(sorted(unknown))}; known: {', '.join(out)}"
            )
        out = {k: v for k, v in out.items() if k in args.cases}
    return out


def run(bench: BenchArgs) -> int:
    args = bench.args
    configure(args)
    started = now()
    load_before = list(os.getloadavg())
    todo = cases(bench)
    found = []
    for name, timed_run in todo.items():
        timed_run()  # page cache warm, compiled kernels cached
        seconds = [timed_run() for _ in range(args.repeats)]
        figures: dict[str, float | None] = {
            "median_s": statistics.median(seconds),
            "min_s": min(seconds),
            "max_s": max(seconds),
        }
        progress(f"  {name}: median {figures['median_s']:.3f} s")
        found.append(
            Case(name=name, params={"case": name}, figures=figures, detail={"seconds": seconds})
        )
    extra: dict[str, Any] = {
        "load_avg_before": load_before,
        "load_avg_after": list(os.getloadavg()),
    }
    if args.timeline:
        tokenizer = describe_model(bench.engine_config().model).tokenizer is not None
        extra["timeline"] = timeline(generate_argv(bench.engine_argv, tokenizer))
    bench.publish(
        started,
        engine=bench.engine_config(),
        cases=found,
        extra=extra,
        columns=COLUMNS,
        title=f"asyncstep bench startup ({args.repeats} runs per case)",
    )
    if extra.get("timeline"):
        progress("start-up timeline of one generate (s from its process's start):")
        for row in extra["timeline"]:
            track, phase = f"{row['track']:13s}", f"{row['phase']:18s}"
            progress(f"  {track} {phase} {row['start_s']:6.2f} +{row['dur_s']:5.2f}")
    return 0
