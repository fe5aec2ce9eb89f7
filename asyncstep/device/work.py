"""Awaiting ``torch.distributed`` Work handles and CUDA events without blocking
the event loop (the backends' behaviour this rests on: docs/architecture.md,
"Awaiting collectives and events").

Contract:

* :func:`wait_work` and :func:`wait_cuda_event` return once the operation
  finished on the device (not merely enqueued), so its buffer may then be
  reused on any stream; the blocking wait runs in a worker thread (gloo's
  ``wait()``, a blocking CUDA event's ``synchronize()``: both release the
  GIL, neither spins); no Python host callback is used.
* Each gloo handle is waited **once**, and every handle stays referenced
  until it completed (:class:`PendingWork` keeps the count and the
  references, even for a waiting thread abandoned by a cancelled task).
* Cancellation: a transfer cannot be cancelled, and its buffer must not be
  reused before it completed. :func:`wait_work` and :func:`wait_cuda_event`
  shield the wait: a cancellation that arrives meanwhile is delivered when
  the wait ends. :meth:`PendingWork.wait` may instead abandon its thread on
  cancellation (``abandon_on_cancel=True``): safe only because the object
  keeps the completion bookkeeping itself, so whoever owns the buffers
  releases them on ``done`` and never earlier.

Imports: torch, anyio and the device runtime's stream module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
import torch.distributed as dist

from asyncstep.device.stream import await_future, cuda_waiter

__all__ = ["PendingWork", "is_cuda", "wait_cuda_event", "wait_work"]


def is_cuda(device: torch.device | str | None) -> bool:
    """Whether ``device`` names a CUDA device (``None`` is the CPU)."""
    return device is not None and torch.device(device).type == "cuda"


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
_SIDE_STREAMS_LOCK = threading.Lock()


def _side_stream(device: torch.device | str) -> torch.cuda.Stream:
    """The stream (one per device) that only ever waits for communication."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _SIDE_STREAMS_LOCK:
        stream = _SIDE_STREAMS.get(index)
        if stream is None:
            stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
        return stream


class PendingWork:
    """A list of Work handles, each waited at most once, with its own
    bookkeeping of what has completed.

    ``device`` says where the handles' tensors live: ``None``/CPU means gloo
    (``wait()`` blocks until completion); a CUDA device means NCCL (completion
    is learned from an event on a side stream, see the module docstring). gloo
    handles (e.g. metadata sent over a CPU group) may be mixed into a CUDA
    list: their ``wait()`` simply blocks until they complete.
    """

    def __init__(
        self, works: Iterable[dist.Work], *, device: torch.device | str | None = None
    ) -> None:
        self._works = list(works)
        self._device = torch.device(device) if device is not None else None
        self._num_done = 0
        self._error: BaseException | None = None
        # Held by the one thread that is waiting (maybe abandoned by its task).
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._works)

    @property
    def device(self) -> torch.device | None:
        """Where the handles' tensors live (None: the CPU, gloo)."""
        return self._device if is_cuda(self._device) else None

    def __repr__(self) -> str:
        return f"PendingWork({self._num_done}/{len(self._works)} done, device={self._device})"

    @property
    def done(self) -> bool:
        """Every handle is known to have completed."""
        return self._num_done == len(self._works)

    @property
    def error(self) -> BaseException | None:
        """The error a ``wait()`` raised, if one did (the handles then never count as done)."""
        return self._error

    @property
    def works(self) -> tuple[dist.Work, ...]:
        return tuple(self._works)

    def wait_blocking(self) -> None:
        """Block this thread until every handle completed.

        Safe to call from several threads: one waits, the others block on a
        lock until it is done. Re-raises the first error of a wait.
        """
        if self.done:
            return
        with self._lock:
            if self.done:
                return
            if self._error is not None:
                raise RuntimeError(f"waiting for {self!r} failed earlier") from self._error
            try:
                if is_cuda(self._device):
                    assert self._device is not None
                    self._wait_cuda_locked(self._device)
                else:
                    while self._num_done < len(self._works):
                        self._works[self._num_done].wait()
                        self._num_done += 1
            except BaseException as exc:
                self._error = exc
                raise

    def _wait_cuda_locked(self, device: torch.device) -> None:
        stream = _side_stream(device)
        with torch.cuda.stream(stream):
            # NCCL: the side stream waits for the end event (no host wait);
            # gloo handles in the list block here until they complete.
            for work in self._works[self._num_done :]:
                work.wait()
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        event.synchronize()
        self._num_done = len(self._works)

    async def wait(self, *, abandon_on_cancel: bool = False) -> None:
        """Wait in a worker thread until every handle completed.

        ``abandon_on_cancel=False``: a cancellation is delivered once the wait
        ended. ``True``: the task leaves at once and the thread keeps waiting
        (it finishes the bookkeeping; a later ``wait`` joins it rather than
        waiting any handle twice) — then check :attr:`done` before reusing
        buffers. Either way the thread counts against anyio's default thread
        limiter until it ends.
        """
        if self.done:
            await anyio.lowlevel.checkpoint()
            return
        await anyio.to_thread.run_sync(self.wait_blocking, abandon_on_cancel=abandon_on_cancel)


async def wait_work(work: dist.Work, *, device: torch.device | str | None = None) -> None:
    """Wait until ``work`` completed, without blocking the event loop.

    ``device`` is where the work's tensors live: CPU/``None`` (gloo) or a CUDA
    device (NCCL; a plain ``work.wait()`` there would only order the current
    stream, see the module docstring). The wait is shielded: the transfer
    cannot be stopped and its buffer must not be reused before it completed,
    so a cancellation is delivered (``Cancelled`` raised) only after the wait
    ended. Call it once per handle (gloo's ``wait()`` must not be repeated).
    """
    pending = PendingWork([work], device=device)
    with anyio.CancelScope(shield=True):
        await pending.wait(abandon_on_cancel=False)
    await anyio.lowlevel.checkpoint_if_cancelled()


async def wait_cuda_event(event: torch.cuda.Event) -> None:
    """Wait until ``event`` completed, without blocking the event loop.

    ``event.synchronize()`` runs in the event's device's long-lived waiter
    thread (:func:`~asyncstep.device.stream.cuda_waiter`, shared by the events
    waited here, one after the other), and the loop is woken by the future's
    done-callback (:func:`~asyncstep.device.stream.await_future`). Create the
    event with ``blocking=True`` so the thread sleeps (and releases the GIL)
    rather than spinning. Shielded like :func:`wait_work`: a cancellation is
    delivered after the event completed.
    """
    if event.query():
        await anyio.lowlevel.checkpoint()
        return
    # Recorded events know their device; the current one otherwise (any
    # thread may synchronize any device's event: this only picks the thread).
    device = getattr(event, "device", None)
    future = cuda_waiter(device).submit(event.synchronize)
    await await_future(future, shield=True)
