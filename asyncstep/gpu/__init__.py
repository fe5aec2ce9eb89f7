"""Awaitables for futures, CUDA events and ``torch.distributed`` Work
(``stream``, ``work``); a rank's launch thread (``host_stream``); later CUDA
graphs and Triton kernels.

May import torch, triton, trio/anyio.
"""

from asyncstep.gpu.host_stream import HostStream, HostStreamStatistics
from asyncstep.gpu.stream import (
    CpuEvent,
    CudaEvent,
    DeviceClock,
    StreamEvent,
    await_future,
    cuda_waiter,
    record_event,
)
from asyncstep.gpu.work import PendingWork, is_cuda, wait_cuda_event, wait_work

__all__ = [
    "CpuEvent",
    "CudaEvent",
    "DeviceClock",
    "HostStream",
    "HostStreamStatistics",
    "PendingWork",
    "StreamEvent",
    "await_future",
    "cuda_waiter",
    "is_cuda",
    "record_event",
    "wait_cuda_event",
    "wait_work",
]
