"""The host benchmark's spans (:mod:`~asyncstep.bench.host_cpu`'s
``--spans``): one more engine, traced through asyncstep's JSON log (that of
``configure_logging``, as ``--log-json`` writes it, :func:`json_logging`;
every file ``FILE*``: the ranks' ``FILE.rank<N>``, an engine-core child's own
file), one request alone, then all of them (:func:`traced_rounds`); then per
process, task and span name the mean µs per step and the count over the
steady decode steps (every request decoding, the first ``--skip-steps`` left
out; :func:`steady_steps`, :func:`span_table`), at batch 1 and at
``--num-requests``.

Imports anyio, asyncstep's public API and logging, and
:mod:`asyncstep.bench.host_peers` (the rounds it traces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shutil
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

import asyncstep
from asyncstep.bench.host_peers import SHAPE, Row, engine_options, one_round
from asyncstep.logging import configure_logging
from asyncstep.logging.spans import now_us
from asyncstep.logging.trace import TASK_ORDER, Span, load_spans

__all__ = [
    "HOST_PATH",
    "json_logging",
    "load_logs",
    "span_table",
    "spans_run",
    "steady_steps",
    "traced_rounds",
]

#: The host path of a step, in order (spans by these names come first in the table).
HOST_PATH = ("schedule", "prepare", "launch", "sample", "update", "detokenize")


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
