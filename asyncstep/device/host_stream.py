"""A rank's launch thread: the host side of a device stream.

:class:`HostStream` is one worker thread that runs submitted callables
strictly in submission order. With CPU tensors it is the stand-in for a CUDA
stream (CPU torch ops are synchronous, so "the thread ran it" is "the device
completed it"); on CUDA it is the thread that enqueues a rank's kernels.

May import torch, anyio and :mod:`asyncstep.device.stream`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar, TypeVarTuple

import torch

from asyncstep.device.stream import CpuEvent, _cuda_index, _now_us, await_future

__all__ = ["HostStream", "HostStreamStatistics", "switch_interval"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """Set the interpreter's thread switch interval (``sys.setswitchinterval``)
    for the block; None leaves it. The launch thread and the event loop share
    the GIL: a thread that wants it waits up to this interval for the other
    to let go, so Python's 5 ms default stalls hand-offs between them (the
    gain of a shorter one varies between machines:
    ``benchmarks/studies/fastpath/README.md``)."""
    if seconds is None:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@dataclass(frozen=True, slots=True)
class HostStreamStatistics:
    name: str
    submitted: int
    """Callables submitted (markers of :meth:`HostStream.record_event` excluded)."""
    completed: int
    """Of those, the ones that ran to the end (returned or raised)."""
    busy_s: float
    """Total seconds the thread spent running them."""


class HostStream:
    """The host side of a device stream: one worker thread that runs submitted
    callables strictly in submission order.

    On a CUDA ``device`` the thread's current device is set to it (a new
    thread's current device is 0); the callables then enqueue device work on
    that thread's current stream, and :meth:`record_event` only says the host
    side ran (use ``await stream.run(record_event, stream.device)`` for a
    :class:`CudaEvent` after it). On the CPU (``None``), the host side *is* the
    device.

    An exception in one callable is its future's and does not stop the stream.

    ``inline=True``: no thread; :meth:`submit` runs the callable at once on
    the caller's thread and returns its finished future. For CUDA, where the
    calls only enqueue device work, this saves the two thread hand-offs per
    call (and their wait for the GIL); the caller's event loop is held while a
    call runs. On the CPU, where a call *is* the device's work, keep the thread.
    """

    def __init__(
        self, name: str, device: torch.device | str | None = None, *, inline: bool = False
    ) -> None:
        self.name = name
        self.inline = inline
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        initializer: Callable[..., object] | None = None
        initargs: tuple[Any, ...] = ()
        if self.device.type == "cuda":
            index = _cuda_index(self.device)
            self.device = torch.device("cuda", index)
            initializer, initargs = torch.cuda.set_device, (index,)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"asyncstep-stream-{name}",
            initializer=initializer,
            initargs=initargs,
        )
        self._lock = threading.Lock()
        self._closed = False
        self._submitted = 0
        self._completed = 0
        self._busy_s = 0.0

    def __repr__(self) -> str:
        return f"HostStream({self.name!r}, device={self.device}, closed={self._closed})"

    @property
    def closed(self) -> bool:
        return self._closed

    def _timed(self, call: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return call()
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._completed += 1
                self._busy_s += elapsed

    def submit(self, fn: Callable[[*Ts], T], *args: *Ts) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)`` after everything submitted before; returns its
        future. ``RuntimeError`` once the stream is closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"stream {self.name!r} is closed")
            self._submitted += 1
            if not self.inline:
                return self._executor.submit(self._timed, lambda: fn(*args))
        return _finished(self._timed, lambda: fn(*args))

    async def run(self, fn: Callable[[*Ts], T], *args: *Ts) -> T:
        """Submit ``fn(*args)`` and await its result. Once submitted the work
        runs to the end: a cancellation is delivered after it finished."""
        return await await_future(self.submit(fn, *args), shield=True)

    def record_event(self) -> CpuEvent:
        """A marker that completes (stamped with the moment) once everything
        submitted before it ran."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"stream {self.name!r} is closed")
            if not self.inline:
                return CpuEvent(self._executor.submit(_now_us))
        return CpuEvent(_finished(_now_us))

    def statistics(self) -> HostStreamStatistics:
        with self._lock:
            return HostStreamStatistics(
                name=self.name,
                submitted=self._submitted,
                completed=self._completed,
                busy_s=self._busy_s,
            )

    def close(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Refuse new work; what was submitted still runs. ``wait=True`` blocks
        until it ran and the thread ended (from async code prefer :meth:`aclose`).
        ``cancel_pending=True`` cancels the work that has not started yet (its
        futures end cancelled); the call running now still finishes."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=cancel_pending)

    async def aclose(self) -> None:
        """Close, and wait without blocking the loop for the submitted work
        (shielded: a cancellation is delivered after it ran)."""
        with self._lock:
            if self._closed or self.inline:
                self._closed = True
                marker = None
            else:
                self._closed = True
                marker = self._executor.submit(_now_us)
        try:
            if marker is not None:
                await await_future(marker, shield=True)
        finally:
            self._executor.shutdown(wait=False)

    def __enter__(self) -> HostStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _finished(fn: Callable[[*Ts], T], *args: *Ts) -> concurrent.futures.Future[T]:
    """A future holding what ``fn(*args)``, run now, returned or raised."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # the future's, as on the thread
        future.set_exception(exc)
    return future
