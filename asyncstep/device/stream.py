"""Device completion as awaitables: futures and stream events (CPU and CUDA).

What it holds:

- :func:`await_future`: await a :class:`concurrent.futures.Future` from Trio or
  asyncio (through AnyIO) without blocking the loop and without polling. The
  future's done-callback wakes the loop thread-safely; ``shield=True`` (the
  default) delivers a cancellation only after the future completed, because the
  work it stands for cannot be stopped and its buffers must not be reused
  before.
- :class:`StreamEvent` and its two kinds: :class:`CpuEvent` (a marker completed
  by a host thread) and :class:`CudaEvent` (a ``torch.cuda.Event`` waited in a
  long-lived waiter thread), both with a wall-clock :meth:`~StreamEvent.timestamp_us`
  (:class:`DeviceClock` maps CUDA event times onto the host clock);
  :func:`record_event` makes the right one for a device.

Facts this is built on (found by experiment; their figures in
``docs/performance.md``): ``trio.sleep`` cannot sleep much less than a
millisecond, so nothing here polls; waking Trio from another thread with
``TrioToken.run_sync_soon`` costs less than a ``trio.to_thread.run_sync`` round
trip, so completion is signalled by a done-callback into the loop
rather than by a thread per wait; ``torch.cuda.Event(blocking=True).synchronize()``
releases the GIL and sleeps, so a long-lived waiter thread per stream costs
nothing while it waits; Python CUDA host callbacks can deadlock against a thread
holding the GIL, so none are used.

Threads are ``concurrent.futures`` workers (not daemons): a callable that never
returns, or a CUDA event that never completes (a hung NCCL peer), keeps the
interpreter from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, TypeVar, TypeVarTuple

import anyio
import anyio.lowlevel
import sniffio
import torch
import trio
import trio.lowlevel

__all__ = [
    "CpuEvent",
    "CudaEvent",
    "DeviceClock",
    "StreamEvent",
    "await_future",
    "cuda_waiter",
    "record_event",
]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def _now_us() -> int:
    return time.time_ns() // 1000


# ---------------------------------------------------------------------------
# await_future


def _loop_waker(callback: Callable[[], object]) -> Callable[[], None]:
    """A function, callable from any thread, that runs ``callback`` soon in the
    current event loop's thread; it does nothing once that loop is gone."""
    library = sniffio.current_async_library()
    schedule: Callable[[Callable[[], object]], object]
    if library == "trio":
        schedule = trio.lowlevel.current_trio_token().run_sync_soon
    elif library == "asyncio":
        schedule = asyncio.get_running_loop().call_soon_threadsafe
    else:  # pragma: no cover - anyio supports only these two
        raise RuntimeError(f"await_future does not support {library!r}")

    def wake() -> None:
        # The loop may have ended (trio.RunFinishedError is a RuntimeError;
        # asyncio: "Event loop is closed"): nobody waits any more.
        with contextlib.suppress(RuntimeError):
            schedule(callback)

    return wake


async def await_future(future: concurrent.futures.Future[T], *, shield: bool = True) -> T:
    """Wait until ``future`` completed and return its result (or raise its
    exception), without blocking the event loop and without polling.

    ``shield=True``: the work the future stands for cannot be cancelled and its
    buffers must not be reused before it completed, so a cancellation that
    arrives meanwhile is delivered (``Cancelled`` raised) only once the future
    completed. ``shield=False``: a cancellation makes the task leave at once;
    the future is left as it is (not cancelled).

    An already completed future costs a checkpoint and no thread hop. Works on
    Trio and on asyncio (as detected by ``sniffio``).
    """
    if future.done():
        await anyio.lowlevel.checkpoint()
        return future.result()
    event = anyio.Event()
    wake = _loop_waker(event.set)
    # If the future completes before or while the callback is registered,
    # add_done_callback runs it right here, in the loop thread, where the
    # scheduling call is as valid as from any other thread: no race.
    future.add_done_callback(lambda _: wake())
    if shield:
        with anyio.CancelScope(shield=True):
            await event.wait()
        await anyio.lowlevel.checkpoint_if_cancelled()
    else:
        await event.wait()
    return future.result()


# ---------------------------------------------------------------------------
# Events


class StreamEvent(ABC):
    """A point in a device stream's work: complete once the device got there."""

    @abstractmethod
    def query(self) -> bool:
        """Whether the event completed (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block this thread until the event completed."""

    @abstractmethod
    async def wait(self) -> None:
        """Wait until the event completed, without blocking the loop; shielded
        like :func:`await_future`: a cancellation is delivered after completion."""

    @abstractmethod
    def timestamp_us(self) -> int:
        """When the device reached the event, in µs since the epoch (the
        ``time.time_ns() // 1000`` clock). Only valid once complete
        (``RuntimeError`` before)."""


class CpuEvent(StreamEvent):
    """An event of the CPU stand-in: a future that the thread doing the work
    completes, after the work, with the moment it did so (µs since the epoch)."""

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future[int]) -> None:
        self._future = future

    @classmethod
    def record(cls) -> CpuEvent:
        """Called on the thread doing the work, after the work: complete at
        once, stamped now."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        future.set_result(_now_us())
        return cls(future)

    @property
    def future(self) -> concurrent.futures.Future[int]:
        return self._future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self._future.result()

    async def wait(self) -> None:
        await await_future(self._future, shield=True)

    def timestamp_us(self) -> int:
        if not self._future.done():
            raise RuntimeError("the event has not completed yet")
        return self._future.result()

    def __repr__(self) -> str:
        state = f"at {self._future.result()} µs" if self._future.done() else "pending"
        return f"CpuEvent({state})"


# -- CUDA -------------------------------------------------------------------


def _cuda_index(device: torch.device | str | int | None) -> int:
    """The index of a CUDA device (``None`` or a bare ``"cuda"``: the current one)."""
    if isinstance(device, int):
        return device
    if device is None:
        return torch.cuda.current_device()
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"not a CUDA device: {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


_WAITERS: dict[tuple[int, int | None], concurrent.futures.ThreadPoolExecutor] = {}
_WAITERS_LOCK = threading.Lock()


def cuda_waiter(
    device: torch.device | str | int | None = None, stream: torch.cuda.Stream | None = None
) -> concurrent.futures.ThreadPoolExecutor:
    """The long-lived thread that waits (``synchronize()``) for CUDA events of
    ``stream`` if given (``device`` is then the stream's), else the device's
    shared one.

    Events on one stream complete in order, so one thread per stream is enough
    and never delays a completed event behind a pending one. The device's
    shared thread (``stream=None``, used by :func:`~asyncstep.device.wait_cuda_event`,
    which does not know the stream) waits events of any stream one after the
    other: an event that completes late (e.g. a receive waiting for its peer)
    delays every event queued behind it.
    """
    index = _cuda_index(device) if stream is None else int(stream.device_index)
    key = (index, None if stream is None else int(stream.stream_id))
    with _WAITERS_LOCK:
        waiter = _WAITERS.get(key)
        if waiter is None:
            suffix = "" if stream is None else f"-s{stream.stream_id}"
            waiter = _WAITERS[key] = concurrent.futures.ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"asyncstep-cuda{index}-waiter{suffix}",
                initializer=torch.cuda.set_device,
                initargs=(index,),
            )
        return waiter


class DeviceClock:
    """Maps CUDA event times onto the host clock (µs since the epoch).

    Calibration (once per device, :meth:`for_device`, on first use): a few
    timing events are recorded on an idle private stream and each is
    synchronized, the host time taken right after; the reference is the first
    event, and its host time the smallest ``host - elapsed`` over the samples
    (the least delayed wake-up). A timestamp is then
    ``t_ref + ref.elapsed_time(event)`` (ms → µs); events older than the
    reference get a negative elapsed time, which is fine.

    Skew: the host time is taken *after* the synchronize returned, so it is
    later than the moment the device reached the reference by the wake-up
    latency (a few µs with the spinning events used for calibration; the
    minimum over the samples removes the jitter, not this bias): every
    timestamp of the device is late by about that much.

    Precision: ``elapsed_time`` is a float32 of milliseconds, whose resolution
    falls with the distance to the reference (~1 µs at 16 s, ~0.25 ms after an
    hour), and the GPU timer drifts from the host's wall clock (ppm; NTP may
    also slew or step the latter). So an event more than
    :attr:`RECALIBRATE_AFTER_MS` after the reference first recalibrates the
    clock (a handful of short synchronizes on the calling thread, at most once
    per that interval). An event that completed long before the reference is
    stamped with the coarser resolution: take timestamps soon after completion.
    """

    RECALIBRATE_AFTER_MS: ClassVar[float] = 16_000.0

    _CLOCKS: ClassVar[dict[int, DeviceClock]] = {}
    _CLOCKS_LOCK: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device: torch.device | str | int | None = None, *, samples: int = 5) -> None:
        self.index = _cuda_index(device)
        self._samples = max(1, samples)
        self._stream = torch.cuda.Stream(device=self.index)
        self._lock = threading.Lock()
        self._reference, self._reference_us = self._calibrate()

    def _calibrate(self) -> tuple[torch.cuda.Event, float]:
        events: list[torch.cuda.Event] = []
        offsets_us: list[float] = []
        for _ in range(self._samples):
            event = torch.cuda.Event(enable_timing=True)  # spins: the quickest wake-up
            event.record(self._stream)
            event.synchronize()
            host_us = time.time_ns() / 1000
            events.append(event)
            elapsed_us = events[0].elapsed_time(event) * 1000 if len(events) > 1 else 0.0
            offsets_us.append(host_us - elapsed_us)
        return events[0], min(offsets_us)

    def recalibrate(self) -> None:
        """Take a new reference (blocks for a few short synchronizes)."""
        reference = self._calibrate()
        with self._lock:
            self._reference, self._reference_us = reference

    @property
    def reference_us(self) -> int:
        """The host time (µs since the epoch) of the current reference event."""
        return round(self._reference_us)

    @classmethod
    def for_device(cls, device: torch.device | str | int | None = None) -> DeviceClock:
        """The device's clock, calibrated on first use."""
        index = _cuda_index(device)
        with cls._CLOCKS_LOCK:
            clock = cls._CLOCKS.get(index)
            if clock is None:
                clock = cls._CLOCKS[index] = cls(index)
            return clock

    def timestamp_us(self, event: torch.cuda.Event) -> int:
        """When the device reached ``event`` (complete, recorded with
        ``enable_timing=True`` on this device), in µs since the epoch."""
        with self._lock:
            reference, reference_us = self._reference, self._reference_us
        elapsed_ms = reference.elapsed_time(event)
        if elapsed_ms > self.RECALIBRATE_AFTER_MS:
            self.recalibrate()
            with self._lock:
                reference, reference_us = self._reference, self._reference_us
            elapsed_ms = reference.elapsed_time(event)
        return round(reference_us + elapsed_ms * 1000)


class CudaEvent(StreamEvent):
    """A ``torch.cuda.Event(blocking=True, enable_timing=True)`` recorded on a
    stream; :meth:`wait` hands ``synchronize()`` to that stream's waiter thread
    (:func:`cuda_waiter`), which sleeps with the GIL released."""

    __slots__ = ("_device", "_event", "_stream", "_timestamp_us")

    def __init__(self, event: torch.cuda.Event, device: int, stream: torch.cuda.Stream) -> None:
        self._event = event
        self._device = device
        self._stream = stream
        self._timestamp_us: int | None = None

    @classmethod
    def record(
        cls, device: torch.device | str | int | None = None, stream: torch.cuda.Stream | None = None
    ) -> CudaEvent:
        """Record a new event on ``stream`` (default: the current stream of
        ``device``, itself defaulting to the current device)."""
        if stream is None:
            index = _cuda_index(device)
            stream = torch.cuda.current_stream(index)
        else:
            index = int(stream.device_index)
        event = torch.cuda.Event(blocking=True, enable_timing=True)
        event.record(stream)
        return cls(event, index, stream)

    @property
    def event(self) -> torch.cuda.Event:
        return self._event

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._stream

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()

    async def wait(self) -> None:
        if self._event.query():
            await anyio.lowlevel.checkpoint()
            return
        future = cuda_waiter(self._device, self._stream).submit(self._event.synchronize)
        await await_future(future, shield=True)

    def timestamp_us(self) -> int:
        if self._timestamp_us is None:
            if not self._event.query():
                raise RuntimeError("the event has not completed yet")
            self._timestamp_us = DeviceClock.for_device(self._device).timestamp_us(self._event)
        return self._timestamp_us

    def __repr__(self) -> str:
        return f"CudaEvent(cuda:{self._device}, stream={self._stream.stream_id})"


def record_event(
    device: torch.device | str | None = None, stream: torch.cuda.Stream | None = None
) -> StreamEvent:
    """An event at the current end of ``device``'s work: on CUDA, a
    :class:`CudaEvent` recorded on ``stream`` (default: the current stream); on
    the CPU, where torch ops are synchronous, :meth:`CpuEvent.record` (complete
    now: call it on the thread that did the work, after the work)."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaEvent.record(device, stream)
    if stream is not None:
        raise ValueError("a CUDA stream was given for a CPU event")
    return CpuEvent.record()
