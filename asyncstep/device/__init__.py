"""The device runtime, apart from kernels: awaitables for futures, CUDA
events and ``torch.distributed`` Work (``stream``, ``work``); a rank's launch
thread (``host_stream``); CUDA-graph capture and its CPU stand-in
(``cuda_graph``). The kernels are :mod:`asyncstep.ops`'.

May import torch, trio/anyio.
"""

from asyncstep.device.cuda_graph import CudaGraph, EagerGraph, GraphPool, capture_graph
from asyncstep.device.host_stream import HostStream, HostStreamStatistics, switch_interval
from asyncstep.device.stream import (
    CpuEvent,
    CudaEvent,
    DeviceClock,
    StreamEvent,
    await_future,
    cuda_waiter,
    record_event,
)
from asyncstep.device.work import PendingWork, is_cuda, wait_cuda_event, wait_work

__all__ = [
    "CpuEvent",
    "CudaEvent",
    "CudaGraph",
    "DeviceClock",
    "EagerGraph",
    "GraphPool",
    "HostStream",
    "HostStreamStatistics",
    "PendingWork",
    "StreamEvent",
    "await_future",
    "capture_graph",
    "cuda_waiter",
    "is_cuda",
    "record_event",
    "switch_interval",
    "wait_cuda_event",
    "wait_work",
]
