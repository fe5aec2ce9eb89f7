"""CPU benchmark of the host path: asyncstep against HF transformers
``generate`` on the ``tiny-llama`` shape (random weights, fp32), in one run,
where the model is so small that the host's time per step is what counts.

Workload: ``--num-requests`` random prompts (seeded; lengths uniform in
``--prompt-len-range``, token ids in [3, vocab)), ``--output-len`` tokens each,
greedy, EOS ignored. The same prompts for both systems.

* **HF**: all requests as one left-padded batch through ``generate`` (static
  cache, eager, ``min_new_tokens = max_new_tokens``); one warm-up run, then
  ``--repeats`` timed runs, median.
* **ours**: ``open_engine("tiny-llama", load_format="dummy", device="cpu")``
  with room for every request at once (``max_num_seqs``, KV blocks) and the
  prompts in about two prefill steps; prefix caching off (every round computes
  what HF computes; ``--engine-opt enable_prefix_caching=true`` turns it on).
  Every request at once in one task group, through ``engine.generate`` and
  (``--streams``) through ``engine.stream``, reading every chunk, as services
  do. A warm-up round (a few requests), then ``--repeats`` timed rounds of each
  variant, interleaved; median.
* **busy caller**: the same generate rounds (``--busy-streams``: the stream
  rounds too) while one more task of the caller's event loop holds it
  ``--busy-ms`` at a time (busy-spins on ``perf_counter``, then
  ``await anyio.lowlevel.checkpoint()``: ``trio.sleep(0)``,
  ``asyncio.sleep(0)``), until the round ends; ``--busy-repeats`` rounds
  (they are the slow ones), median: tok/s and busy / undisturbed.
* **spans** (``--spans``, on by default): one more engine, traced (the JSON log
  of ``configure_logging``, as ``--log-json`` does; every file ``FILE*``: the
  ranks' ``FILE.rank<N>``, an engine-core child's own file), one request alone,
  then all of them. Per process, task and span name: the mean µs per step and
  the count over the steady decode steps (every request decoding, the first
  ``--skip-steps`` left out), at batch 1 and at ``--num-requests``. Tracing
  costs time: the tok/s figures come from the untraced rounds only.

tok/s = num_requests x output_len / seconds of the round (prefill included).
Other work on the machine skews every figure: the other processes' CPU use
is recorded (``other_load``; per round ``other_cores``). The default run takes
about 1.5 minutes on 2 cores. Prints the tables; ``--out`` writes every
figure in ``asyncstep bench``'s results format (a case per system and
variant; the workload, ratios and spans in its ``extra``)::

    python3 -m asyncstep.bench.host_cpu --out FILE
    python3 -m asyncstep.bench.host_cpu --engine-opt engine_process=true
    python3 -m asyncstep.bench.host_cpu --backend asyncio --no-hf --no-spans --busy-streams

``--backend``: the caller's event loop, Trio (the default) or asyncio (through
AnyIO, as an asyncio service runs the engine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import torch

import asyncstep
from asyncstep import SamplingParams
from asyncstep.bench import hf as bench_hf
from asyncstep.bench.latency import kv_blocks
from asyncstep.bench.measurement import add_engine_opt, record, row_case
from asyncstep.bench.results import Result, machine_info, write
from asyncstep.logging import configure_logging
from asyncstep.logging.spans import now_us
from asyncstep.logging.trace import TASK_ORDER, Span, load_spans
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import get_shape

SHAPE = "tiny-llama"
BLOCK_SIZE = 16
#: The host path of a step, in order (spans by these names come first in the table).
HOST_PATH = ("schedule", "prepare", "launch", "sample", "update", "detokenize")
Row = dict[str, Any]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--prompt-len-range", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed HF runs and rounds per variant (median)"
    )
    parser.add_argument(
        "--busy-repeats", type=int, default=3, help="timed busy-caller rounds (at most --repeats)"
    )
    parser.add_argument(
        "--warmup-requests", type=int, default=8, help="requests of our warm-up round"
    )
    parser.add_argument(
        "--streams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time engine.stream (every chunk read)",
    )
    parser.add_argument(
        "--busy-ms",
        type=float,
        default=2.0,
        help="the busy caller holds the event loop this long at a time (0: no busy rounds)",
    )
    parser.add_argument(
        "--busy-streams",
        action="store_true",
        help="also time engine.stream with the busy caller (the slowest rounds: off by default)",
    )
    parser.add_argument(
        "--spans",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one traced round: host time per step by span",
    )
    parser.add_argument(
        "--skip-steps", type=int, default=4, help="steady decode steps left out at the start"
    )
    parser.add_argument("--trace-dir", type=Path, help="keep the span logs here")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument(
        "--backend",
        choices=("trio", "asyncio"),
        default="trio",
        help="the caller's event loop (asyncio through AnyIO)",
    )
    add_engine_opt(
        parser,
        "extra open_engine keyword (repeatable; overrides the sizing), e.g. engine_process=true",
    )
    parser.add_argument("--out", type=Path, help="write every figure here as JSON")
    args = parser.parse_args(argv)
    lo, hi = args.prompt_len_range
    if not 1 <= lo <= hi:
        parser.error("--prompt-len-range wants 1 <= MIN <= MAX")
    if min(args.num_requests, args.output_len, args.repeats, args.busy_repeats) < 1:
        parser.error("--num-requests, --output-len, --repeats and --busy-repeats must be >= 1")
    return args


# -- the workload ---------------------------------------------------------------


def make_prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts, lengths uniform in [lo, hi], token ids in [3, vocab)."""
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


def tok_s(rounds: Sequence[float], tokens: int) -> float:
    return tokens / statistics.median(rounds)


# -- HF -------------------------------------------------------------------------


def hf_run(arch: ModelArchConfig, prompts: list[list[int]], output_len: int, repeats: int) -> Row:
    """One left-padded batch of every prompt through ``generate``: a warm-up
    run, then ``repeats`` timed runs; tok/s of the median."""
    options = bench_hf.HfOptions(
        device=torch.device("cpu"), dtype=torch.float32, compile=False, warmups=1, repeats=repeats
    )
    ids, mask = bench_hf.left_pad(prompts, max(len(p) for p in prompts), options.device)

    def work(model: Any) -> list[float]:
        bench_hf.timed_generate(model, ids, mask, output_len, output_len)  # warm-up
        return [
            bench_hf.timed_generate(model, ids, mask, output_len, output_len)
            for _ in range(repeats)
        ]

    seconds = bench_hf.with_model(arch, options, work)
    return {
        "tok_s": tok_s(seconds, len(prompts) * output_len),
        "seconds": seconds,
        "batch": list(ids.shape),
        "source": options.label,
    }


# -- our engine -----------------------------------------------------------------


def engine_options(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """open_engine keywords: dummy weights on the CPU in fp32, room for every
    request at once, the prompts in about two steps; then ``--engine-opt``."""
    total = sum(len(p) for p in prompts)
    lengths = [len(p) + args.output_len for p in prompts]
    warm = [len(p) + args.output_len for p in prompts[: args.warmup_requests]]
    options: dict[str, Any] = {
        "load_format": "dummy",
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": len(prompts),
        "max_num_batched_tokens": max(-(-total // 2), max(len(p) for p in prompts), 256),
        "max_model_len": max(lengths) + BLOCK_SIZE,
        "block_size": BLOCK_SIZE,
        "num_blocks": kv_blocks([*lengths, *warm], BLOCK_SIZE),
        "enable_prefix_caching": False,
    }
    options.update(dict(args.engine_opt))
    return options


class BusyCaller:
    """A task of the caller's loop that holds it ``hold_s`` at a time."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.holds = 0
        self.held_s = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            end = start + self.hold_s
            while time.perf_counter() < end:
                pass
            self.holds += 1
            self.held_s += time.perf_counter() - start
            await anyio.lowlevel.checkpoint()  # = trio.sleep(0), asyncio.sleep(0)


async def one_round(
    engine: asyncstep.Engine,
    prompts: list[list[int]],
    output_len: int,
    *,
    stream: bool = False,
    busy_s: float = 0.0,
) -> Row:
    """Every request at once (generate, or stream reading every chunk), with
    the busy caller when ``busy_s``; the round's seconds and counts."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    tokens: list[int] = []
    chunks: list[int] = []

    async def one(prompt: list[int]) -> None:
        if stream:
            n = k = 0
            async for chunk in engine.stream(prompt, params):
                n += len(chunk.token_ids)
                k += 1
            tokens.append(n)
            chunks.append(k)
        else:
            tokens.append(len((await engine.generate(prompt, params)).token_ids))

    await engine.wait_idle()
    cpu_start = cpu_seconds()
    busy = BusyCaller(busy_s)
    async with anyio.create_task_group() as outer:
        if busy_s > 0:
            outer.start_soon(busy.run)
        start = time.perf_counter()
        async with anyio.create_task_group() as nursery:
            for prompt in prompts:
                nursery.start_soon(one, prompt)
        seconds = time.perf_counter() - start
        outer.cancel_scope.cancel()
    if tokens != [output_len] * len(prompts):
        raise RuntimeError(f"generated {sum(tokens)} tokens, asked for {output_len * len(prompts)}")
    row: Row = {
        "seconds": seconds,
        "other_cores": other_load(cpu_start, seconds).get("other_cores"),
    }
    if stream:
        row["chunks"] = sum(chunks)
    if busy_s > 0:
        row["holds"] = busy.holds
        row["held_fraction"] = busy.held_s / seconds
    return row


def variants(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The timed variants: name -> one_round keywords."""
    out: dict[str, dict[str, Any]] = {"generate": {}}
    if args.streams:
        out["stream"] = {"stream": True}
    if args.busy_ms > 0:
        busy = {"busy_s": args.busy_ms / 1e3}
        out["busy_generate"] = busy
        if args.streams and args.busy_streams:
            out["busy_stream"] = {"stream": True, **busy}
    return out


async def ours_run(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Row]:
    """A warm-up round, then ``--repeats`` rounds of every variant (interleaved)."""
    tokens = len(prompts) * args.output_len
    runs: dict[str, list[Row]] = defaultdict(list)
    async with asyncstep.open_engine(SHAPE, **engine_options(args, prompts)) as engine:
        warm = prompts[: args.warmup_requests]
        await one_round(engine, warm, args.output_len)
        if args.streams:
            await one_round(engine, warm, args.output_len, stream=True)
        for i in range(args.repeats):
            for name, kw in variants(args).items():
                if "busy_s" in kw and i >= args.busy_repeats:
                    continue
                runs[name].append(await one_round(engine, prompts, args.output_len, **kw))
    results: dict[str, Row] = {}
    for name, rows in runs.items():
        seconds = [r["seconds"] for r in rows]
        results[name] = {"tok_s": tok_s(seconds, tokens), "seconds": seconds, "rounds": rows}
        print(f"  ours {name}: {results[name]['tok_s']:.0f} tok/s", flush=True)
    return results


# -- spans ----------------------------------------------------------------------


async def traced_rounds(
    args: argparse.Namespace, prompts: list[list[int]], span_log: Path
) -> dict[str, tuple[int, int]]:
    """A traced engine: a warm-up, then one request alone, then every request;
    each phase's time window (µs since the epoch, the spans' clock)."""
    options = {"rank_log_json": str(span_log), **engine_options(args, prompts)}
    windows: dict[str, tuple[int, int]] = {}
    async with asyncstep.open_engine(SHAPE, **options) as engine:
        await one_round(engine, prompts[: args.warmup_requests], args.output_len)
        for phase, batch in (("batch_1", prompts[:1]), (f"batch_{len(prompts)}", prompts)):
            await engine.wait_idle()
            start = now_us()
            await one_round(engine, batch, args.output_len)
            windows[phase] = (start, now_us())
    return windows


def process_label(path: Path, span_log: Path) -> str:
    """``main`` for the log itself, else its suffix (``rank0``, ...)."""
    return path.name[len(span_log.name) :].lstrip(".") or "main"


def load_logs(span_log: Path) -> tuple[list[tuple[str, Span]], dict[int, Row]]:
    """Every span of ``FILE*`` with its process label, and each step's
    ``step`` event (num_reqs, num_tokens), by step id."""
    paths = sorted(p for p in span_log.parent.glob(span_log.name + "*") if p.is_file())
    spans: list[tuple[str, Span]] = []
    steps: dict[int, Row] = {}
    for path in paths:
        with contextlib.suppress(ValueError):  # a file without spans
            spans += [(process_label(path, span_log), s) for s in load_spans([path])]
        with path.open("rb") as lines:
            for line in lines:
                if b'"step"' not in line or b'"num_reqs"' not in line:
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if entry.get("event") == "step" and isinstance(entry.get("step"), int):
                    steps.setdefault(entry["step"], entry)
    if not spans:
        raise ValueError(f"{span_log}*: no spans")
    return spans, steps


def steady_steps(
    spans: Sequence[tuple[str, Span]],
    steps: dict[int, Row],
    window: tuple[int, int],
    batch: int,
    skip: int,
) -> tuple[list[int], str]:
    """The steady decode steps of a phase: steps that started in its window
    where every one of ``batch`` requests decodes one token (by the steps'
    events; without them every step of the window), the first ``skip`` left
    out (at least one kept)."""
    first: dict[int, int] = {}
    for _, s in spans:
        if s.step is not None:
            first[s.step] = min(first.get(s.step, s.ts_us), s.ts_us)
    inside = sorted(step for step, ts in first.items() if window[0] <= ts <= window[1])
    if steps:
        how = f"step events: num_reqs == num_tokens == {batch}"
        inside = [
            step
            for step in inside
            if steps.get(step, {}).get("num_reqs") == batch
            and steps.get(step, {}).get("num_tokens") == batch
        ]
    else:
        how = "every step of the phase's window (no step events)"
    if inside:
        inside = inside[min(skip, len(inside) - 1) :]
    return inside, f"{how}; first {skip} left out"


def order_key(key: tuple[str, str, str]) -> tuple[Any, ...]:
    process, task, name = key
    path = HOST_PATH.index(name) if name in HOST_PATH else len(HOST_PATH)
    track = TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER)
    return (process != "main", process, path, track, task, name)


def span_table(spans: Sequence[tuple[str, Span]], selected: Sequence[int]) -> Row:
    """Per (process, task, name) over the selected steps: mean µs per step,
    count, mean µs per span; the step period (median gap between the starts
    of consecutive steps)."""
    chosen = set(selected)
    totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    starts: dict[int, int] = {}
    for process, s in spans:
        if s.step in chosen:
            total = totals[process, s.task, s.name]
            total[0] += 1
            total[1] += s.dur_us
            if s.task == "engine" and s.name == "schedule":
                starts[s.step] = s.ts_us
    rows = [
        {
            "process": process,
            "task": task,
            "name": name,
            "us_per_step": dur / len(chosen),
            "count": count,
            "us_per_span": dur / count,
        }
        for (process, task, name), (count, dur) in sorted(
            totals.items(), key=lambda i: order_key(i[0])
        )
    ]
    gaps = [starts[s + 1] - starts[s] for s in sorted(starts) if s + 1 in starts]
    return {
        "steps": len(chosen),
        "first_step": min(selected, default=None),
        "last_step": max(selected, default=None),
        "step_period_us": statistics.median(gaps) if gaps else math.nan,
        "rows": rows,
    }


@contextlib.contextmanager
def json_logging(span_log: Path) -> Iterator[None]:
    """asyncstep's JSON log (the spans) to ``span_log`` inside; then its
    logger as it was (an unconfigured one stays unconfigured: a test's
    later log capture still sees asyncstep's events)."""
    logger = logging.getLogger("asyncstep")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    for handler in handlers:  # kept, not closed, by configure_logging
        logger.removeHandler(handler)
    configure_logging("warning", span_log, console=False)
    try:
        yield
    finally:
        configure_logging("warning", console=False)  # closes the JSON file
        for handler in handlers:
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def spans_run(args: argparse.Namespace, prompts: list[list[int]]) -> Row:
    """The traced rounds and their span tables, per phase."""
    log_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="host_cpu_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    span_log = log_dir / "host_cpu.jsonl"
    with json_logging(span_log):
        windows = anyio.run(traced_rounds, args, prompts, span_log, backend=args.backend)
    try:
        spans, steps = load_logs(span_log)
        files = sorted({process for process, _ in spans})
        out: Row = {"processes": files, "phases": {}}
        for phase, window in windows.items():
            batch = int(phase.removeprefix("batch_"))
            selected, how = steady_steps(spans, steps, window, batch, args.skip_steps)
            out["phases"][phase] = {"batch": batch, "selected_by": how} | span_table(
                spans, selected
            )
    finally:
        if args.trace_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    out["logs"] = str(span_log) + "*" if args.trace_dir else None
    return out


# -- output ---------------------------------------------------------------------


def code_version() -> Row:
    """Where the asyncstep that ran lives, and its git commit (None outside a
    checkout) and whether its package files differ from that commit."""
    package = Path(asyncstep.__file__).resolve().parent

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(package), *argv], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--", ".") if commit else None
    return {"path": str(package), "git_commit": commit, "git_dirty": bool(changed)}


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``; ``-`` (as wide) when there is no value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        width = spec.split(".")[0]
        return format("-", f">{width}" if width.isdigit() else "")
    return format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def ratios(result: Row) -> Row:
    hf = (result.get("hf") or {}).get("tok_s")
    ours = result["ours"]
    out: Row = {}
    for name in ("generate", "stream"):
        mine = (ours.get(name) or {}).get("tok_s")
        out[f"{name}_over_hf"] = ratio(mine, hf)
        out[f"busy_{name}_over_{name}"] = ratio((ours.get(f"busy_{name}") or {}).get("tok_s"), mine)
    return {key: value for key, value in out.items() if value is not None}


def print_tables(result: Row) -> None:
    w = result["workload"]
    print(
        f"\n{w['num_requests']} requests x {w['output_len']} tokens, prompts "
        f"{w['prompt_len_range'][0]}-{w['prompt_len_range'][1]} tokens, {SHAPE} fp32 on "
        f"{result['machine']['cpu_count']} CPU cores ({torch.get_num_threads()} torch threads),"
        f" the caller's loop {result['options']['backend']}"
    )
    other = result["other_load"]
    print(
        f"other processes used {fmt(other.get('other_cores'), '.2f')} cores on average"
        f" during the run (load average {other['load_average'][0]:.2f})"
    )
    hf = (result.get("hf") or {}).get("tok_s")
    r, ours = result["ratios"], result["ours"]
    header = f"{'':10} {'HF tok/s':>9} {'ours tok/s':>10} {'ours/HF':>8}"
    header += f" {'busy tok/s':>10} {'busy/undisturbed':>17}"
    print(header)
    for name in ("generate", "stream"):
        if name not in ours:
            continue
        busy = (ours.get(f"busy_{name}") or {}).get("tok_s")
        print(
            f"{name:10} {fmt(hf, '9.0f')} {ours[name]['tok_s']:10.0f}"
            f" {fmt(r.get(f'{name}_over_hf'), '8.2f')} {fmt(busy, '10.0f')}"
            f" {fmt(r.get(f'busy_{name}_over_{name}'), '17.2f')}"
        )
    spans = result.get("spans")
    if not spans:
        return
    for phase, table in spans["phases"].items():
        print(
            f"\nhost time per step by span, {phase.replace('_', ' ')} (traced;"
            f" {table['steps']} steady decode steps {table['first_step']}-{table['last_step']},"
            f" step period {fmt(table['step_period_us'], '.0f')} µs)"
        )
        print(f"{'process':8} {'task':8} {'span':18} {'µs/step':>9} {'count':>6} {'µs/span':>9}")
        for row in table["rows"]:
            print(
                f"{row['process']:8} {row['task']:8} {row['name']:18} {row['us_per_step']:9.1f}"
                f" {row['count']:6d} {row['us_per_span']:9.1f}"
            )
    print("(on the CPU, launch is the forward itself; the device spans overlap it)")


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, of this process and its
    children: the waited-for and the running, the engine-core process and
    the ranks) so far; None without ``/proc/stat``."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    mine = os.times()
    ours = mine.user + mine.system + mine.children_user + mine.children_system
    ticks = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / ticks, ours + descendants_cpu_s()


def descendants_cpu_s() -> float:
    """CPU seconds of this process's running descendants (their own, and
    their waited-for children's), from ``/proc``."""
    parents: dict[int, int] = {}
    seconds: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        seconds[pid] = sum(int(f) for f in fields[11:15]) / ticks  # utime stime cutime cstime
    mine, total, frontier = os.getpid(), 0.0, [os.getpid()]
    children: dict[int, list[int]] = defaultdict(list)
    for pid, parent in parents.items():
        children[parent].append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child != mine:
                total += seconds[child]
                frontier.append(child)
    return total


def other_load(start: tuple[float, float] | None, wall_s: float) -> Row:
    """What else ran on the machine during the benchmark: other processes' CPU
    seconds, and as a mean number of busy cores (load average alongside)."""
    end = cpu_seconds()
    if start is None or end is None:
        return {"load_average": list(os.getloadavg())}
    other = max((end[0] - start[0]) - (end[1] - start[1]), 0.0)
    return {
        "other_cpu_s": other,
        "other_cores": other / wall_s,
        "load_average": list(os.getloadavg()),
    }


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> Row:
    """Every part of the benchmark; the result as written to ``--out``
    (``argv``: the command line's arguments, recorded)."""
    started = datetime.now(UTC)
    cpu_start, wall_start = cpu_seconds(), time.perf_counter()  # other work skews figures
    arch = get_shape(SHAPE)
    lo, hi = args.prompt_len_range
    prompts = make_prompts(arch.vocab_size, args.num_requests, lo, hi, args.seed)
    hf = None
    if not args.no_hf:
        hf = bench_hf.guarded("generate", hf_run, arch, prompts, args.output_len, args.repeats)
        print(f"  HF   generate: {fmt(hf.get('tok_s'), '.0f')} tok/s", flush=True)
    ours = anyio.run(ours_run, args, prompts, backend=args.backend)
    machine = msgspec.to_builtins(machine_info()) | {"torch_threads": torch.get_num_threads()}
    result: Row = {
        "command": "python3 -m asyncstep.bench.host_cpu " + shlex.join(argv),
        "argv": list(argv),
        "python": sys.executable,
        "date": started.isoformat(timespec="seconds"),
        "machine": machine,
        "asyncstep": code_version(),
        "options": vars(args),
        "workload": {
            "shape": SHAPE,
            "num_requests": args.num_requests,
            "output_len": args.output_len,
            "prompt_len_range": [lo, hi],
            "prompt_tokens": sum(len(p) for p in prompts),
            "output_tokens": args.num_requests * args.output_len,
            "seed": args.seed,
        },
        "engine_options": engine_options(args, prompts),
        "hf": hf,
        "ours": ours,
    }
    result["ratios"] = ratios(result)
    if args.spans:
        result["spans"] = spans_run(args, prompts)
    result["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    result["other_load"] = other_load(cpu_start, time.perf_counter() - wall_start)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = run(args, argv)
    print_tables(result)
    write(to_record(result), args.out)
    return 0


def to_record(result: Row) -> Result:
    """The run in ``asyncstep bench``'s results format: a case per system
    and variant (HF's ``generate``, ours by variant), the rest (the
    workload, the ratios, the spans, the other load) in ``extra``."""
    rows = [{"system": "hf", "variant": "generate", **result["hf"]}] if result["hf"] else []
    rows += [{"system": "asyncstep", "variant": k, **v} for k, v in result["ours"].items()]
    extra_keys = ("workload", "engine_options", "ratios", "spans", "other_load", "asyncstep")
    return record(
        "host_cpu",
        result["argv"],
        result["date"],
        options=result["options"],
        cases=[row_case(row, ["system", "variant"]) for row in rows],
        extra={key: result[key] for key in extra_keys if key in result}
        | {"torch_threads": result["machine"]["torch_threads"]},
    )


if __name__ == "__main__":
    raise SystemExit(main())
