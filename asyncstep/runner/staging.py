"""Host staging of a step's inputs: numpy arrays to device tensors without a
host sync (vLLM's pinned ``CpuGpuBuffer`` + ``prepare_inputs_event``).

With async scheduling the host prepares step N+1 while the device still runs
step N, so an input copy must neither wait for the stream (a copy from
pageable memory, or a blocking one, does) nor overwrite host memory that an
earlier copy still reads. On CUDA each named input has a persistent pinned
buffer; copies from it are non-blocking; :meth:`StagingBuffers.end_step`
records an event after the step's copies and :meth:`begin_step` waits for the
previous step's event before any buffer is written again. That event only
covers the copies (enqueued before the forward), so the wait is short.

On the CPU a device tensor is the array itself (``torch.from_numpy``).

:class:`StagedArena` serves static inputs (the CUDA-graph runner's): its
device tensors are views of one device allocation, mirrored by one pinned
host allocation, so a step writes its arrays into the host views with numpy
and moves them all with one copy (each copy costs host time, whatever its
size; a decode step has six such inputs).

May import torch and numpy only.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["StagedArena", "StagingBuffers"]

#: Region alignment in the arena (bytes): any dtype's view is aligned.
_ALIGN = 64


class StagingBuffers:
    """Per-name pinned host buffers, reused every step behind an event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        #: Recorded after the last step's copies; waited before writing again.
        self.prepare_inputs_event: torch.cuda.Event | None = None

    def begin_step(self) -> None:
        """Wait until the previous step's copies have read their buffers."""
        if self.prepare_inputs_event is not None:
            self.prepare_inputs_event.synchronize()
            self.prepare_inputs_event = None

    def to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device (non-blocking on CUDA, through ``name``'s buffer)."""
        array = np.ascontiguousarray(array)
        if not self.pinned:
            return torch.from_numpy(array)
        source = torch.from_numpy(array)
        host = self._buffer(name, source)
        host.copy_(source)
        return host.to(self.device, non_blocking=True)

    def end_step(self) -> None:
        """Mark the end of this step's copies on the current stream."""
        if self.pinned:
            event = torch.cuda.Event(blocking=True)
            event.record()
            self.prepare_inputs_event = event

    def _buffer(self, name: str, source: torch.Tensor) -> torch.Tensor:
        numel = source.numel()
        host = self._host.get(name)
        if host is None or host.numel() < numel or host.dtype != source.dtype:
            # Grown (or first use): the old buffer's copies were waited for
            # in begin_step, so dropping it is safe.
            size = max(numel, 2 * host.numel() if host is not None else 256)
            host = torch.empty(size, dtype=source.dtype, pin_memory=True)
            self._host[name] = host
        return host[:numel].view(source.shape)


class StagedArena:
    """Named static device tensors in one allocation, with host views of a
    pinned mirror (on the CPU the host views are the tensors themselves).

    Write a step's values into :attr:`host` (numpy), then :meth:`upload`
    copies the arena's prefix up to the last row used in one non-blocking
    copy. Regions keep their declaration order: declare the small ones
    first and the one whose used rows vary most (the block table) last.
    The caller orders host writes after the previous upload has read them
    (:meth:`StagingBuffers.begin_step`).
    """

    def __init__(
        self, device: torch.device, regions: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> None:
        self._offsets: dict[str, tuple[int, int]] = {}  # name -> (offset, bytes per row)
        total = 0
        for name, (shape, dtype) in regions.items():
            row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            self._offsets[name] = (total, row_bytes)
            total += -(-(row_bytes * shape[0]) // _ALIGN) * _ALIGN
        self._device = torch.zeros(total, dtype=torch.uint8, device=device)
        self._pinned = device.type == "cuda"
        mirror = torch.zeros(total, dtype=torch.uint8, pin_memory=True) if self._pinned else None
        host_bytes = (mirror if mirror is not None else self._device).numpy()
        self._mirror = mirror
        #: The static device tensors.
        self.tensors: dict[str, torch.Tensor] = {}
        #: Their host views (numpy), written before :meth:`upload`.
        self.host: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in regions.items():
            offset, row_bytes = self._offsets[name]
            end = offset + row_bytes * shape[0]
            self.tensors[name] = self._device[offset:end].view(dtype).view(shape)
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            self.host[name] = host_bytes[offset:end].view(np_dtype).reshape(shape)

    def upload(self, last: str, rows: int) -> None:
        """Copy every region before ``last`` and ``last``'s first ``rows`` rows."""
        if self._mirror is None:
            return  # the host views are the device tensors
        offset, row_bytes = self._offsets[last]
        end = offset + row_bytes * rows
        self._device[:end].copy_(self._mirror[:end], non_blocking=True)
