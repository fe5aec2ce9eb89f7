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

May import torch and numpy only.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["StagingBuffers"]


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

    def copy_to(self, name: str, array: np.ndarray, dst: torch.Tensor) -> None:
        """Copy ``array`` into the device tensor ``dst`` (same number of
        elements; non-blocking on CUDA, through ``name``'s buffer)."""
        source = torch.from_numpy(np.ascontiguousarray(array)).view(dst.shape)
        if source.dtype != dst.dtype:
            source = source.to(dst.dtype)
        if self.pinned:
            host = self._buffer(name, source)
            host.copy_(source)
            source = host
        dst.copy_(source, non_blocking=self.pinned)

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
