"""Step-timeline spans: one structlog event per finished span.

A span is one interval of one task's life in one step: ``recv_wait``,
``prepare``, ``launch``, ``forward`` (device time, from events), ``sample``,
``copy``, ``output``, ``send_drain``, ... Each is logged as one DEBUG event on
the logger ``asyncstep.trace``::

    {"event": "span", "name": "prepare", "task": "step", "rank": 0, "step": 7,
     "ts_us": 1764450000123456, "dur_us": 412, ...}

``ts_us`` is the start in microseconds since the epoch (``time.time_ns``), so
spans of several processes on one machine line up; ``dur_us`` the length.
``task`` names the track (``recv``, ``step``, ``send``, ``sampler``,
``device``, ``engine``); ``rank`` and ``step`` come from the contextvars
(:func:`~asyncstep.logging.bind_rank`, :func:`~asyncstep.logging.bound_step`)
unless given. ``asyncstep trace`` turns these lines into a Chrome/Perfetto
trace or a picture.

Tracing is off unless the ``asyncstep.trace`` logger is enabled for DEBUG
(``configure_logging(json_file=...)`` does that): :func:`tracing` is then a
single cached level check, and :func:`span` records nothing.

May import structlog and the standard library only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from asyncstep.logging.setup import get_logger

TRACE_LOGGER = "asyncstep.trace"

_trace_logger = logging.getLogger(TRACE_LOGGER)
_log = get_logger(TRACE_LOGGER)


def now_us() -> int:
    """Microseconds since the epoch (the clock of every span)."""
    return time.time_ns() // 1000


def tracing() -> bool:
    """Whether spans are recorded (the trace logger is enabled for DEBUG)."""
    return _trace_logger.isEnabledFor(logging.DEBUG)


def record_span(name: str, task: str, ts_us: int, dur_us: int, **fields: Any) -> None:
    """Log one finished span (no-op when tracing is off)."""
    if tracing():
        _log.debug("span", name=name, task=task, ts_us=ts_us, dur_us=max(dur_us, 0), **fields)


@contextmanager
def span(name: str, task: str, **fields: Any) -> Iterator[None]:
    """Record the time spent inside as one span (also when it raises)."""
    if not tracing():
        yield
        return
    start = now_us()
    try:
        yield
    finally:
        record_span(name, task, start, now_us() - start, **fields)
