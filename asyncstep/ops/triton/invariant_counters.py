"""The arrival counters of the batch-invariant matmul's split programs
(issue 40).

A tile's split programs each bump the tile's int32 counter once their
partial is written; the last to arrive adds the partials and resets the
counter, so a buffer is all zeros between kernels. :func:`tile_counters`
keeps one buffer a device and stream (two streams' kernels may run at
once) for good, since a captured CUDA graph holds it: allocated zeroed on
an eager launch; a stream first seen capturing a graph takes one of
:data:`RESERVE` buffers zeroed with the device's first eager launch (a
buffer allocated in a capture would be zeroed only when its graph
replays), and where none is left the caller runs a program per tile (the
same bits).

May import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["COUNTERS", "RESERVE", "DeviceCounters", "tile_counters", "zeroed_counters"]

#: Zeroed buffers a device keeps for streams first seen capturing a graph.
RESERVE = 4


@dataclass
class DeviceCounters:
    """A device's counters: a buffer a stream, and the capturing streams'
    ``reserve``."""

    by_stream: dict[int, torch.Tensor]
    reserve: list[torch.Tensor]


COUNTERS: dict[torch.device, DeviceCounters] = {}


def zeroed_counters(device: torch.device, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)


def tile_counters(device: torch.device, size: int) -> torch.Tensor | None:
    """The ``size`` counters of ``device``'s current stream (see the
    module's docstring); None where a capturing stream finds none."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    state = COUNTERS.get(device)
    if state is None:
        if capturing:
            return None
        state = DeviceCounters({}, [zeroed_counters(device, size) for _ in range(RESERVE)])
        COUNTERS[device] = state
    counters = state.by_stream.get(stream)
    if counters is None:
        if capturing and not state.reserve:
            return None
        counters = state.reserve.pop() if capturing else zeroed_counters(device, size)
        state.by_stream[stream] = counters
    return counters
