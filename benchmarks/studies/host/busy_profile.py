"""Where a busy caller costs the engine its speed: ``asyncstep.bench.host_cpu``'s
workload (tiny-llama, dummy weights, CPU), one traced round of each of
``generate``, ``stream``, busy ``generate``, busy ``stream`` (the busy
caller: one more task of the caller's loop spins ``--busy-ms``, then yields,
until the round ends), after a warm-up round.

Per round:

* **tok/s** of the round (traced: lower than host_cpu.py's);
* **core**: its steps in the round and their median period (gap between the
  starts of consecutive ``schedule`` spans of the engine-core process), the
  core's busy window (first ``schedule`` to last ``update`` end);
* **front end**: each step's lag, from the core's ``update`` end (the step's
  outputs go out) to the front end's ``output`` span (the step's outputs
  processed), median / p90 / max; the **drain**, from the core's last
  ``update`` end to the round's end (what the round waited for the front
  end); the ``output`` span's µs per step;
* **the caller's loop** (Trio only, an instrument): task steps and their
  time per engine step, by task, and the loop's idle time (every task asleep);
* **wake-ups** of the callers (their waits that returned) per request;
* **CPU seconds** of this process and of the engine-core child.

Tracing and the instrument cost time: the tok/s of host_cpu.py's untraced
rounds are the figures; these say where the time goes::

    python benchmarks/studies/host/busy_profile.py --out FILE.json
    python benchmarks/studies/host/busy_profile.py --backend asyncio --out FILE.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import trio

import asyncstep
from asyncstep.bench import host_cpu, host_peers, host_spans
from asyncstep.bench.measurement import add_engine_opt
from asyncstep.bench.results import machine_info
from asyncstep.engine.front_end import request_state
from asyncstep.logging.spans import now_us
from asyncstep.logging.trace import Span, load_spans
from asyncstep.models.dummy import get_shape

Row = dict[str, Any]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-len-range", type=int, nargs=2, default=[16, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy-ms", type=float, default=2.0)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--backend", choices=("trio", "asyncio"), default="trio")
    parser.add_argument("--out", type=Path)
    add_engine_opt(parser, "extra open_engine keyword (repeatable)")
    return parser.parse_args(argv)


class LoopProfile(trio.abc.Instrument):
    """Trio's task steps on the caller's loop: count and seconds by task
    name; seconds the loop slept in its I/O wait."""

    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.idle_s = 0.0
        self._start: float | None = None
        self._io_start = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._start = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._start is None:  # the step that added the instrument
            return
        name = task_kind(task.name)
        self.steps[name] += 1
        self.seconds[name] += time.perf_counter() - self._start
        self._start = None

    def before_io_wait(self, timeout: float) -> None:
        self._io_start = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self.idle_s += time.perf_counter() - self._io_start


def task_kind(name: str) -> str:
    """A task's name without its per-request suffix."""
    return name.rsplit(".", 1)[-1] if "<locals>" in name else name


class Wakeups:
    """Counts the callers' waits for news (each ends in one wake-up):
    ``RequestGroup._waiting`` calls, or the waits of a version without it
    (``RequestGroup._wait``)."""

    def __init__(self) -> None:
        self.count = 0
        group = request_state.RequestGroup
        self._name = "_waiting" if hasattr(group, "_waiting") else "_wait"
        self._original = getattr(group, self._name)

    def __enter__(self) -> Wakeups:
        original = self._original

        def counted(group: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(group, *args, **kwargs)

        setattr(request_state.RequestGroup, self._name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(request_state.RequestGroup, self._name, self._original)


def child_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (its threads) so far."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    return time.process_time()


async def profiled_round(
    engine: asyncstep.Engine,
    prompts: list[list[int]],
    args: argparse.Namespace,
    *,
    stream: bool,
    busy: bool,
) -> Row:
    """One round of host_cpu.py's, with its window, wake-ups, CPU and (Trio) loop profile."""
    profile = LoopProfile() if args.backend == "trio" else None
    pid = getattr(engine.core, "pid", None)
    await engine.wait_idle()
    cpu0, child0 = own_cpu_s(), child_cpu_s(pid)
    if profile is not None:
        trio.lowlevel.add_instrument(profile)
    start = now_us()
    with Wakeups() as wakeups:
        row = await host_peers.one_round(
            engine,
            prompts,
            args.output_len,
            stream=stream,
            busy_s=args.busy_ms / 1e3 if busy else 0.0,
        )
    end = now_us()
    if profile is not None:
        trio.lowlevel.remove_instrument(profile)
    child1 = child_cpu_s(pid)
    row |= {
        "window_us": [start, end],
        "tok_s": len(prompts) * args.output_len / row["seconds"],
        "wakeups_per_request": wakeups.count / len(prompts),
        "cpu_s_front_end": own_cpu_s() - cpu0,
        "cpu_s_core": None if child0 is None or child1 is None else child1 - child0,
    }
    if profile is not None:
        row["loop"] = {
            "idle_s": profile.idle_s,
            "tasks": {
                name: {"steps": profile.steps[name], "seconds": profile.seconds[name]}
                for name in sorted(profile.seconds, key=lambda n: -profile.seconds[n])
            },
        }
    return row


ROUNDS = {
    "generate": {"stream": False, "busy": False},
    "stream": {"stream": True, "busy": False},
    "busy_generate": {"stream": False, "busy": True},
    "busy_stream": {"stream": True, "busy": True},
}


async def rounds(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Row]:
    out: dict[str, Row] = {}
    async with asyncstep.open_engine(
        host_peers.SHAPE, **host_peers.engine_options(args, prompts)
    ) as engine:
        warm = prompts[: args.warmup_requests]
        await host_peers.one_round(engine, warm, args.output_len)
        await host_peers.one_round(engine, warm, args.output_len, stream=True)
        for name, kw in ROUNDS.items():
            out[name] = await profiled_round(engine, prompts, args, **kw)
            print(f"  {name}: {out[name]['tok_s']:.0f} tok/s (traced)", flush=True)
    return out


def quantiles(values: list[float]) -> Row:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
        "count": len(ordered),
    }


def step_figures(spans: list[tuple[str, Span]], row: Row) -> Row:
    """The core's and the front end's figures of one round's window."""
    lo, hi = row["window_us"]
    schedule: dict[int, int] = {}
    update_end: dict[int, int] = {}
    output: dict[int, Span] = {}
    for process, s in spans:
        if s.step is None or not lo <= s.ts_us <= hi:
            continue
        if process == "core" and s.task == "engine" and s.name == "schedule":
            schedule[s.step] = s.ts_us
        elif process == "core" and s.task == "engine" and s.name == "update":
            update_end[s.step] = s.ts_us + s.dur_us
        elif process == "main" and s.task == "frontend" and s.name == "output":
            output[s.step] = s
    steps = sorted(schedule)
    gaps = [schedule[b] - schedule[a] for a, b in itertools.pairwise(steps)]
    lags = [output[s].ts_us - update_end[s] for s in update_end if s in output]
    last_update = max(update_end.values(), default=hi)
    return {
        "core_steps": len(steps),
        "core_step_period_us": statistics.median(gaps) if gaps else None,
        "core_window_ms": (last_update - min(schedule.values(), default=lo)) / 1e3,
        "front_end_lag_us": quantiles([float(x) for x in lags]),
        "drain_ms": (hi - last_update) / 1e3,
        "output_us_per_step": statistics.mean(s.dur_us for s in output.values())
        if output
        else None,
    }


def label(path: Path, log: Path) -> str:
    suffix = path.name[len(log.name) :].lstrip(".")
    return suffix or "main"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    arch = get_shape(host_peers.SHAPE)
    prompts = host_cpu.make_prompts(
        arch.vocab_size, args.num_requests, *args.prompt_len_range, args.seed
    )
    log_dir = Path(tempfile.mkdtemp(prefix="busy_profile_"))
    span_log = log_dir / "profile.jsonl"
    started = datetime.now(UTC)
    try:
        with host_spans.json_logging(span_log):
            results = anyio.run(rounds, args, prompts, backend=args.backend)
        spans: list[tuple[str, Span]] = []
        for path in sorted(log_dir.glob(span_log.name + "*")):
            try:
                spans += [(label(path, span_log), s) for s in load_spans([path])]
            except ValueError:
                continue
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    for row in results.values():
        row.update(step_figures(spans, row))
    print_rounds(results, args)
    if args.out is not None:
        out = {
            "command": "python benchmarks/studies/host/busy_profile.py " + " ".join(argv),
            "date": started.isoformat(timespec="seconds"),
            "machine": msgspec.to_builtins(machine_info()),
            "asyncstep": host_cpu.code_version(),
            "options": vars(args),
            "engine_options": host_peers.engine_options(args, prompts),
            "main_thread": threading.main_thread().name,
            "rounds": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


def print_rounds(results: dict[str, Row], args: argparse.Namespace) -> None:
    print(f"\ncaller's loop: {args.backend}; {args.num_requests} x {args.output_len} tokens")
    for name, r in results.items():
        lag = r["front_end_lag_us"]
        print(
            f"{name:14} {r['tok_s']:7.0f} tok/s  core: {r['core_steps']} steps,"
            f" period {r['core_step_period_us'] or 0:.0f} us, window {r['core_window_ms']:.0f} ms;"
            f" drain {r['drain_ms']:.1f} ms; lag med {lag.get('median', 0):.0f}"
            f" p90 {lag.get('p90', 0):.0f} max {lag.get('max', 0):.0f} us;"
            f" output {r['output_us_per_step'] or 0:.0f} us/step;"
            f" wake-ups/request {r['wakeups_per_request']:.1f};"
            f" CPU s front end {r['cpu_s_front_end']:.2f} core {r['cpu_s_core'] or 0:.2f}"
        )
        loop = r.get("loop")
        if loop:
            steps = max(r["core_steps"], 1)
            print(f"    loop idle {loop['idle_s']:.3f} s; per engine step, by task:")
            for task, t in list(loop["tasks"].items())[:8]:
                print(
                    f"      {t['steps'] / steps:8.1f} steps {t['seconds'] / steps * 1e6:9.0f} us"
                    f"  {task}"
                )


if __name__ == "__main__":
    raise SystemExit(main())
