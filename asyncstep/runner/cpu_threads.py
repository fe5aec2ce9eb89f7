"""The OpenMP threads of a CPU rank.

A CPU rank's steps run on its launch thread with ``cpu_threads`` torch
threads, and that thread alone may keep OpenMP threads: each thread that ran
a multi-threaded torch op keeps a pool of its own until it ends, and libgomp
spins between parallel regions only while the threads it manages fit the
cores. With a second pool every op of a step waits for its helpers to wake
from a futex. So the work before the steps (loading, the KV cache) runs in
:func:`run_in_ending_thread`. For the same reason the steps take fewer
threads while other processes use the cores (:class:`CpuThreads`). Imports anyio and torch.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import torch

T = TypeVar("T")


async def run_in_ending_thread(fn: Callable[[], T], name: str = "asyncstep-setup") -> T:
    """``fn()`` in a new thread that has ended when this returns (its OpenMP
    threads with it); not cancellable, as a worker thread of anyio's is not."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return await anyio.to_thread.run_sync(pool.submit(fn).result)
    finally:
        pool.shutdown(wait=True)


def _busy_ticks(cpus: frozenset[int]) -> int:
    """Clock ticks the CPUs in ``cpus`` spent busy since boot (/proc/stat)."""
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name == "cpu":
                continue
            if not name.startswith("cpu"):
                break
            if int(name[3:]) in cpus:
                ticks = [int(x) for x in fields[:8]]
                busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return busy


@dataclass
class CpuThreads:
    """The torch threads of a CPU rank's steps: ``threads``, fewer while
    other processes keep this process's cores busy (a busy caller, another
    engine): a team with a descheduled thread stalls at every join. Each
    ``window_s`` :meth:`apply` (on the launch thread, before a step) takes
    the cores the others used (/proc/stat's busy time less this process's
    CPU time) and drops a thread when they leave less than ``current - 0.5``
    cores free, adds one back when ``current + 0.8`` are free."""

    threads: int
    window_s: float = 0.1
    _cpus: frozenset[int] = field(
        default_factory=lambda: frozenset(os.sched_getaffinity(0)), init=False
    )
    _current: int = field(default=0, init=False)
    _last: tuple[float, int, float] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # A first sample now, so that the first step (often seconds later,
        # at start-up, while other processes are busy) already knows the load.
        with contextlib.suppress(OSError, ValueError, IndexError):
            self._last = (time.monotonic(), _busy_ticks(self._cpus), sum(os.times()[:2]))

    def apply(self) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.window_s:
            if self._current == 0:
                self._set(self.threads)
            return
        own = sum(os.times()[:2])
        try:
            busy = _busy_ticks(self._cpus)
        except (OSError, ValueError, IndexError):  # no /proc/stat as Linux writes it
            self.window_s = math.inf
            self._set(self.threads)
            return
        if self._last is not None:
            wall = now - self._last[0]
            others = ((busy - self._last[1]) / _TICKS - (own - self._last[2])) / wall
            free = len(self._cpus) - max(0.0, others)
            down, up = math.floor(free + 0.5), math.floor(free + 0.2)
            if self._current > down:
                self._set(max(1, min(self.threads, down)))
            elif self._current < up:
                self._set(max(1, min(self.threads, up)))
        elif self._current == 0:
            self._set(self.threads)
        self._last = (now, busy, own)

    def _set(self, threads: int) -> None:
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads


_TICKS = os.sysconf("SC_CLK_TCK")
