"""A pool of reusable tensors for the pipeline-parallel channel's staging and
receive buffers, keyed by ``(shape, dtype, device)``.

A buffer is handed out by :meth:`BufferPool.acquire` and given back by
:meth:`BufferPool.release`, the very tensor object (not a view of it). With
``poison=True`` every buffer handed out fresh and every buffer given back is
filled with NaN (floating point), ``True`` (bool) or a sentinel (integers: the
type's minimum, its maximum for unsigned types), so a use after release shows.
The channel's packed buffers are uint8: poisoned, every byte is ``0xFF``, which
reads as NaN through a view of any floating-point dtype (and as ``-1`` through
a signed integer one).

CUDA buffers are stream-ordered: ``release`` records an event on the current
stream, and the ``acquire`` that hands the buffer out again makes its current
stream wait for that event, so kernels that read the buffer before it was
released finish before anything enqueued after the new ``acquire`` writes it.

Thread-safe: the receive thread acquires while the event loop releases.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["BufferPool", "BufferPoolStatistics", "poison_value"]

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]


@dataclass(frozen=True)
class BufferPoolStatistics:
    #: ``acquire`` calls so far.
    acquired: int
    #: ``release`` calls so far (that succeeded).
    released: int
    #: Buffers handed out and not yet released.
    in_use: int
    #: Buffers the pool allocated so far (an ``acquire`` that reused an idle buffer does not count).
    allocated: int
    #: Buffers waiting in the pool.
    idle: int
    #: Bytes of the buffers the pool holds now (in use and idle).
    nbytes: int


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What a poisoned buffer of ``dtype`` is filled with."""
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return True
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def _normalize_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class BufferPool:
    """Reusable tensors, keyed by ``(shape, dtype, device)``."""

    def __init__(self, *, poison: bool = False, name: str = "buffers") -> None:
        self.poison = poison
        self.name = name
        self._lock = threading.Lock()
        self._idle: dict[_Key, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        #: id(buffer) -> buffer, for every buffer the pool owns (in use or idle).
        self._owned: dict[int, torch.Tensor] = {}
        self._in_use: dict[int, torch.Tensor] = {}
        self._acquired = 0
        self._released = 0
        self._allocated = 0

    def __repr__(self) -> str:
        return f"BufferPool({self.name!r}, {self.statistics()})"

    def acquire(
        self,
        shape: Sequence[int] | int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """A buffer of this shape, dtype and device: an idle one, or a new one.

        Its content is undefined (poisoned with ``poison=True``). Give it back
        with :meth:`release`, once nothing uses it any more.
        """
        dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        dev = _normalize_device(device)
        key: _Key = (dims, dtype, dev)
        with self._lock:
            self._acquired += 1
            idle = self._idle.get(key)
            entry = idle.pop() if idle else None
            if entry is not None:
                self._in_use[id(entry[0])] = entry[0]
        if entry is not None:
            buf, ready = entry
            if ready is not None:
                torch.cuda.current_stream(dev).wait_event(ready)
            return buf
        buf = torch.empty(dims, dtype=dtype, device=dev)
        if self.poison:
            buf.fill_(poison_value(dtype))
        with self._lock:
            self._allocated += 1
            self._owned[id(buf)] = buf
            self._in_use[id(buf)] = buf
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back; it may be handed out again at once.

        Raises ``ValueError`` for a tensor this pool did not hand out (a view
        of a buffer counts as such) and ``RuntimeError`` for a buffer released
        twice.
        """
        key_id = id(buf)
        with self._lock:
            if self._owned.get(key_id) is not buf:
                raise ValueError(
                    f"{self.name}: release() of a tensor this pool did not hand out "
                    f"(shape {tuple(buf.shape)}, {buf.dtype}); release the buffer "
                    "acquire() returned, not a view or a copy"
                )
            if self._in_use.pop(key_id, None) is None:
                raise RuntimeError(
                    f"{self.name}: buffer (shape {tuple(buf.shape)}, {buf.dtype}) released twice"
                )
        # Not in use and not idle yet: nobody else can touch it now.
        if self.poison:
            buf.fill_(poison_value(buf.dtype))
        ready = None
        if buf.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        key: _Key = (tuple(buf.shape), buf.dtype, buf.device)
        with self._lock:
            self._released += 1
            self._idle.setdefault(key, []).append((buf, ready))

    def in_use(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is one of this pool's buffers, handed out and not released."""
        with self._lock:
            return self._in_use.get(id(buf)) is buf

    def clear(self) -> int:
        """Drop the idle buffers (to free memory); returns how many."""
        with self._lock:
            dropped = [buf for entries in self._idle.values() for buf, _ in entries]
            self._idle.clear()
            for buf in dropped:
                del self._owned[id(buf)]
        return len(dropped)

    def statistics(self) -> BufferPoolStatistics:
        with self._lock:
            return BufferPoolStatistics(
                acquired=self._acquired,
                released=self._released,
                in_use=len(self._in_use),
                allocated=self._allocated,
                idle=sum(len(entries) for entries in self._idle.values()),
                nbytes=sum(b.numel() * b.element_size() for b in self._owned.values()),
            )
