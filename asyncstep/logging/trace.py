"""``asyncstep trace``: step-timeline spans (:mod:`asyncstep.logging.spans`),
read back from ``--log-json`` files, turned into a Chrome/Perfetto trace
(``.json``, open it in https://ui.perfetto.dev or ``chrome://tracing``) or a
PNG timeline, and summed up per task and span name.

Tracks: one process per rank (``rank 0``, ``rank 1``, ...) plus ``engine``
for spans without a rank; one thread per task, in the order recv, step,
device, sampler, send, then any other task by name.

May import only the standard library, structlog and msgspec; matplotlib is
imported lazily, inside :func:`draw_timeline`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

TASK_ORDER: tuple[str, ...] = ("recv", "step", "device", "sampler", "send")
"""Tasks whose tracks come first, in this order; the others follow by name."""

ENGINE_PID = 0
"""Chrome-trace pid of the engine process; rank ``r`` gets pid ``r + 1``."""

OUTPUT_SUFFIXES: tuple[str, ...] = (".json", ".png", ".txt")

_DPI = 120
_WIDTH_IN = 14.0


@dataclass(frozen=True)
class Span:
    """One finished span: ``name`` on track ``task`` of ``rank`` (None: the
    engine) during ``step`` (None: outside any step); times in µs."""

    name: str
    task: str
    rank: int | None
    step: int | None
    ts_us: int
    dur_us: int

    @property
    def end_us(self) -> int:
        """The end, in microseconds since the epoch."""
        return self.ts_us + self.dur_us


# -- reading ---------------------------------------------------------------


def load_spans(paths: Iterable[str | Path]) -> list[Span]:
    """Every span of the JSON-lines logs ``paths`` (e.g. one per rank), by
    start time. Lines that are not JSON objects with ``"event": "span"`` are
    skipped. Raises FileNotFoundError for a missing file and ValueError when
    none of the files holds a span."""
    files = [Path(p) for p in paths]
    if not files:
        raise ValueError("no log files given")
    for path in files:
        if not path.is_file():
            what = "is not a file" if path.exists() else "no such log file"
            raise FileNotFoundError(f"{path}: {what}")
    spans: list[Span] = []
    for path in files:
        spans.extend(_read_spans(path))
    if not spans:
        names = ", ".join(str(f) for f in files)
        raise ValueError(f"{names}: no spans (was the run logged with --log-json?)")
    spans.sort(key=lambda s: (s.ts_us, s.end_us))
    return spans


def _read_spans(path: Path) -> Iterator[Span]:
    decoder = msgspec.json.Decoder()
    with path.open("rb") as lines:
        for line in lines:
            if b'"span"' not in line:  # cheap pre-filter: most lines are not spans
                continue
            try:
                record = decoder.decode(line)
            except msgspec.DecodeError:
                continue
            span = span_from_record(record)
            if span is not None:
                yield span


def span_from_record(record: Any) -> Span | None:
    """The span a decoded log line holds, or None when it is not a (well-formed) span."""
    if not isinstance(record, dict) or record.get("event") != "span":
        return None
    name, task = record.get("name"), record.get("task")
    ts_us, dur_us = _as_int(record.get("ts_us")), _as_int(record.get("dur_us"))
    if not isinstance(name, str) or not isinstance(task, str) or ts_us is None or dur_us is None:
        return None
    return Span(
        name=name,
        task=task,
        rank=_as_int(record.get("rank")),
        step=_as_int(record.get("step")),
        ts_us=ts_us,
        dur_us=max(dur_us, 0),
    )


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return round(value)


# -- tracks ----------------------------------------------------------------


def process_id(rank: int | None) -> int:
    """The Chrome-trace pid of a rank (the engine: :data:`ENGINE_PID`)."""
    return ENGINE_PID if rank is None else rank + 1


def process_name(rank: int | None) -> str:
    """``"engine"`` or ``"rank N"``."""
    return "engine" if rank is None else f"rank {rank}"


def task_ids(spans: Iterable[Span]) -> dict[str, int]:
    """A small tid per task, the same in every process, in track order."""
    tasks = {s.task for s in spans}
    known = [t for t in TASK_ORDER if t in tasks]
    others = sorted(tasks - set(TASK_ORDER))
    return {task: tid for tid, task in enumerate(known + others, start=1)}


def tracks(spans: Iterable[Span]) -> list[tuple[int | None, str]]:
    """The (rank, task) tracks that hold spans: engine first, then by rank,
    tasks in :func:`task_ids` order."""
    spans = list(spans)
    tids = task_ids(spans)
    found = {(s.rank, s.task) for s in spans}
    return sorted(found, key=lambda t: (process_id(t[0]), tids[t[1]]))


def track_label(rank: int | None, task: str) -> str:
    """E.g. ``"rank 0 · step"``."""
    return f"{process_name(rank)} · {task}"


# -- selecting steps -------------------------------------------------------


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` (or ``"A"``, for A:A) as the inclusive range (A, B)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            first = last = int(parts[0])
        elif len(parts) == 2:
            first, last = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--steps wants A:B (two step numbers), got {text!r}") from None
    if first > last:
        raise ValueError(f"--steps {text}: the first step is after the last")
    return first, last


def select_steps(spans: Sequence[Span], steps: tuple[int, int]) -> list[Span]:
    """The spans of steps ``steps[0]..steps[1]`` (inclusive), plus the spans
    without a step that overlap their time window. Raises ValueError when no
    span has a step in that range."""
    first, last = steps
    inside = [s for s in spans if s.step is not None and first <= s.step <= last]
    if not inside:
        raise ValueError(f"no spans in steps {first}:{last}")
    start = min(s.ts_us for s in inside)
    end = max(s.end_us for s in inside)
    return [
        s
        for s in spans
        if (s.step is not None and first <= s.step <= last)
        or (s.step is None and s.ts_us <= end and s.end_us >= start)
    ]


# -- Chrome / Perfetto trace -----------------------------------------------


def to_chrome_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """The spans in Chrome's trace event format: one complete (``"X"``)
    event per span, ``ts`` in µs from the first span's start, plus the
    metadata events that name and order the processes and threads."""
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(s.ts_us for s in spans)
    tids = task_ids(spans)
    events = _metadata_events(spans, tids)
    for s in spans:
        event: dict[str, Any] = {
            "ph": "X",
            "name": s.name,
            "cat": s.task,
            "ts": s.ts_us - t0,
            "dur": s.dur_us,
            "pid": process_id(s.rank),
            "tid": tids[s.task],
            "args": {} if s.step is None else {"step": s.step},
        }
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _metadata_events(spans: Sequence[Span], tids: dict[str, int]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    ranks = sorted({s.rank for s in spans}, key=process_id)
    for rank in ranks:
        pid = process_id(rank)
        events.append(_meta("process_name", pid, 0, name=process_name(rank)))
        events.append(_meta("process_sort_index", pid, 0, sort_index=pid))
    for rank, task in tracks(spans):
        pid, tid = process_id(rank), tids[task]
        events.append(_meta("thread_name", pid, tid, name=task))
        events.append(_meta("thread_sort_index", pid, tid, sort_index=tid))
    return events


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def write_chrome_trace(spans: Sequence[Span], path: str | Path) -> None:
    """Write :func:`to_chrome_trace` of the spans to ``path`` (JSON)."""
    with Path(path).open("w", encoding="utf-8") as out:
        json.dump(to_chrome_trace(spans), out, separators=(",", ":"))


# -- picture ---------------------------------------------------------------


def draw_timeline(
    spans: Sequence[Span],
    path: str | Path,
    *,
    steps: tuple[int, int] | None = None,
    title: str | None = None,
) -> None:
    """Draw the spans as a PNG timeline at ``path``: one row per (process,
    task) track, one bar per span coloured by its name, x in ms from the
    first span shown. ``steps=(a, b)`` keeps steps a..b only (see
    :func:`select_steps`). Needs matplotlib (``asyncstep[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("drawing a PNG needs matplotlib: pip install 'asyncstep[plot]'") from exc

    shown = select_steps(spans, steps) if steps is not None else list(spans)
    if not shown:
        raise ValueError("no spans to draw")
    rows = tracks(shown)
    colours = _colours([s.name for s in shown])
    fig, ax = plt.subplots(figsize=(_WIDTH_IN, 0.5 * len(rows) + 2), dpi=_DPI, layout="constrained")
    try:
        _draw_bars(ax, shown, rows, colours)
        ax.set_yticks(range(len(rows)), [track_label(r, t) for r, t in rows])
        ax.set_ylim(len(rows) - 0.5, -0.5)  # first track on top
        ax.set_xlabel("time (ms)")
        ax.set_axisbelow(True)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(title if title is not None else _default_title(shown, steps))
        handles = [Patch(color=c, label=n) for n, c in colours.items()]
        fig.legend(handles=handles, loc="outside right upper", title="span", fontsize="small")
        fig.savefig(path, dpi=_DPI)
    finally:
        plt.close(fig)


def _draw_bars(
    ax: Any, spans: Sequence[Span], rows: list[tuple[int | None, str]], colours: dict[str, Any]
) -> None:
    t0 = min(s.ts_us for s in spans)
    row_of = {track: i for i, track in enumerate(rows)}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        bars[row_of[(s.rank, s.task)], s.name].append(((s.ts_us - t0) / 1e3, s.dur_us / 1e3))
    for (row, name), xranges in bars.items():
        ax.broken_barh(xranges, (row - 0.4, 0.8), facecolors=colours[name], linewidth=0)


def _colours(names: Iterable[str]) -> dict[str, Any]:
    """A colour per span name, in order of first appearance."""
    import matplotlib

    ordered = list(dict.fromkeys(names))
    cmap = matplotlib.colormaps["tab10" if len(ordered) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(ordered)}


def _default_title(spans: Sequence[Span], steps: tuple[int, int] | None) -> str:
    numbered = [s.step for s in spans if s.step is not None]
    if steps is not None:
        what = f"steps {steps[0]}–{steps[1]}"
    elif numbered:
        what = f"steps {min(numbered)}–{max(numbered)}"
    else:
        what = "no steps"
    return f"asyncstep step timeline: {len(spans)} spans, {what}"


# -- summary ---------------------------------------------------------------


def summarize(spans: Iterable[Span]) -> dict[str, dict[str, float]]:
    """Per ``"task/name"`` (tracks in :func:`task_ids` order, then by name):
    ``count``, ``total_ms`` and ``mean_ms`` over every process."""
    spans = list(spans)
    tids = task_ids(spans)
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for s in spans:
        total = totals[s.task, s.name]
        total[0] += 1
        total[1] += s.dur_us
    summary: dict[str, dict[str, float]] = {}
    for task, name in sorted(totals, key=lambda k: (tids[k[0]], k[1])):
        count, dur_us = totals[task, name]
        summary[f"{task}/{name}"] = {
            "count": float(count),
            "total_ms": dur_us / 1e3,
            "mean_ms": dur_us / 1e3 / count,
        }
    return summary


# -- command line ----------------------------------------------------------


def run_trace_command(logs: list[str], output: str, steps: str | None) -> str:
    """``asyncstep trace LOG... -o OUTPUT [--steps A:B]``: write a Chrome
    trace (``.json``), a PNG timeline (``.png``) or a listing (``.txt``) of the logs' spans and
    return a one-line description of what was written. Raises ValueError or
    OSError (FileNotFoundError for a missing log) for bad input."""
    suffix = Path(output).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        allowed = " or ".join(OUTPUT_SUFFIXES)
        raise ValueError(f"{output}: the output must end in {allowed} (got {suffix or 'none'!r})")
    step_range = parse_steps(steps) if steps is not None else None
    spans = load_spans(logs)
    if step_range is not None:
        spans = select_steps(spans, step_range)
    if suffix == ".json":
        write_chrome_trace(spans, output)
    elif suffix == ".txt":
        write_span_listing(spans, output)
    else:
        draw_timeline(spans, output)
    processes = len({s.rank for s in spans})
    where = "" if step_range is None else f" (steps {step_range[0]}:{step_range[1]})"
    return (
        f"wrote {output}: {len(spans)} spans{where}, "
        f"{processes} process{'es' if processes != 1 else ''}, {len(tracks(spans))} tracks"
    )


def span_listing(spans: Sequence[Span]) -> list[str]:
    """One line per span in start order: start (ms after the first span),
    duration (ms), process, task, name and step."""
    if not spans:
        return []
    t0 = min(s.ts_us for s in spans)
    return [
        f"{(s.ts_us - t0) / 1e3:10.3f} {s.dur_us / 1e3:8.3f}  {process_name(s.rank):8} "
        f"{s.task:8} {s.name:16} {'' if s.step is None else s.step}".rstrip()
        for s in sorted(spans, key=lambda s: s.ts_us)
    ]


def write_span_listing(spans: Sequence[Span], path: str | Path) -> None:
    header = f"{'start ms':>10} {'dur ms':>8}  {'process':8} {'task':8} {'span':16} step"
    Path(path).write_text("\n".join([header, *span_listing(spans)]) + "\n", encoding="utf-8")


def trace_main(args: argparse.Namespace) -> int:
    """The ``trace`` subcommand's handler: 0 when written, 1 (and one
    ``asyncstep: error: ...`` line on stderr) for bad input."""
    try:
        print(run_trace_command(args.logs, args.output, args.steps))
    except (OSError, ValueError, ImportError) as exc:
        print(f"asyncstep: error: {_describe(exc)}", file=sys.stderr)
        return 1
    return 0


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error)


def add_trace_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Register ``trace`` on the subparsers of ``asyncstep``'s parser.

    The parsed Namespace then carries ``handler`` (:func:`trace_main`, which
    takes the Namespace and returns the exit status). asyncstep.cli dispatches it
    *before* touching generate-only options such as ``args.verbose``::

        commands = parser.add_subparsers(dest="command", required=True)
        add_trace_parser(commands)
        ...
        args = build_parser().parse_args(argv)
        if (handler := getattr(args, "handler", None)) is not None:
            return handler(args)
    """
    parser = subparsers.add_parser(
        "trace",
        help="turn step-timeline spans (--log-json files) into a Chrome trace or a PNG",
        description=(
            "Read the step-timeline spans of one or more --log-json files (e.g. one per "
            "rank) and write a Chrome/Perfetto trace (OUTPUT.json: open it in "
            "https://ui.perfetto.dev), a timeline picture (OUTPUT.png) or a span listing "
            "(OUTPUT.txt)."
        ),
    )
    parser.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines log file(s)")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        help="OUTPUT.json (Chrome trace), OUTPUT.png (picture) or OUTPUT.txt (listing)",
    )
    parser.add_argument(
        "--steps", metavar="A:B", help="only steps A to B (inclusive), and what overlaps them"
    )
    parser.set_defaults(handler=trace_main)
