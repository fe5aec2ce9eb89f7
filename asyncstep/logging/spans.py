"""Step-timeline spans: one JSON line per finished span.

A span is one interval of one task's life in one step: ``recv_post``,
``prepare``, ``launch``, ``forward`` (device time, from events), ``sample``,
``copy_wait``, ``output``, ``send_drain``, ... Each is one line of the JSON
log file that :func:`~asyncstep.logging.configure_logging` opens::

    {"event": "span", "name": "prepare", "task": "step", "ts_us": 1764450000123456,
     "dur_us": 412, "rank": 0, "step": 7}

``ts_us`` is the start in microseconds since the epoch (``time.time_ns``), so
spans of several processes on one machine line up; ``dur_us`` the length.
``task`` names the track (``recv``, ``step``, ``send``, ``sampler``,
``device``, ``engine``); ``rank`` and ``step`` come from the contextvars
(:func:`~asyncstep.logging.bind_rank`, :func:`~asyncstep.logging.bound_step`)
unless given. ``asyncstep trace`` turns these lines into a Chrome/Perfetto
trace or a picture.

Spans bypass structlog's processor chain (an event through it costs several
spans): a span is one ``json.dumps`` and one locked, buffered write to the
JSON file's handler, because spans are recorded on the hot path of every step (and
the event loop's Python time is taken from the launch thread, through the
GIL). Tracing is off unless a JSON file is configured: :func:`tracing` is
then one global check and :func:`span` records nothing.

May import structlog and the standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog

_sink: logging.StreamHandler[Any] | None = None


def set_span_sink(handler: logging.StreamHandler[Any] | None) -> None:
    """Write spans through ``handler``'s stream (None: tracing off). Called
    by ``configure_logging`` with its JSON file handler."""
    global _sink
    _sink = handler


def now_us() -> int:
    """Microseconds since the epoch (the clock of every span)."""
    return time.time_ns() // 1000


def process_start_us() -> int:
    """When this process started, on :func:`now_us`'s clock (to the kernel's
    tick, ~10 ms; now where ``/proc`` cannot tell)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as uptime:
            up_s = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return now_us()
    age_s = up_s - ticks / os.sysconf("SC_CLK_TCK")
    return now_us() - max(int(age_s * 1e6), 0)


#: The tracks of start-up spans: the front end's (imports, model description,
#: tokenizer) and the engine core's (imports, weights, packing, KV cache,
#: warm-up), in whichever process the core runs.
STARTUP = "startup"
CORE_STARTUP = "core_startup"


def record_startup(name: str, since_us: int, *, task: str = STARTUP, **fields: Any) -> None:
    """One start-up span from ``since_us`` to now on track ``task``: the
    timeline that ``asyncstep trace`` draws beside the steps."""
    record_span(name, task, since_us, now_us() - since_us, **fields)


def tracing() -> bool:
    """Whether spans are recorded (a JSON log file is configured)."""
    return _sink is not None


def record_span(name: str, task: str, ts_us: int, dur_us: int, **fields: Any) -> None:
    """Write one finished span (no-op when tracing is off)."""
    sink = _sink
    if sink is None:
        return
    event = {"event": "span", "name": name, "task": task, "ts_us": ts_us, "dur_us": max(dur_us, 0)}
    event.update(structlog.contextvars.get_contextvars())
    event.update(fields)
    line = json.dumps(event, separators=(",", ":")) + "\n"
    sink.acquire()
    try:
        if sink.stream is not None:  # None once the handler was closed
            sink.stream.write(line)  # buffered: flushed with the next event, or at close
    finally:
        sink.release()


@contextmanager
def span(name: str, task: str, **fields: Any) -> Iterator[None]:
    """Record the time spent inside as one span (also when it raises)."""
    if _sink is None:
        yield
        return
    start = now_us()
    try:
        yield
    finally:
        record_span(name, task, start, now_us() - start, **fields)
