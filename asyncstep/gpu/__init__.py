"""Awaitables for futures, CUDA events and ``torch.distributed`` Work
(``stream``, ``work``); a rank's launch thread (``host_stream``); CUDA-graph
capture and its CPU stand-in (``cuda_graph``); Triton kernels: paged
attention and the KV-cache store (``triton_attention``; its kernels in
``attention_kernels``, ``decode_kernels``), fused add + RMSNorm, silu * up,
rotary (+ store) (``triton_fused``), the one-row GEMV of dense 16-bit
weights (``triton_gemv``), Q4 / Q8 weights (``triton_quant``; their layouts
in ``quant_layout``, their kernels in ``quant_kernels``) (all imported
lazily: triton is optional on the CPU).

May import torch, triton, trio/anyio.
"""

from asyncstep.gpu.cuda_graph import CudaGraph, EagerGraph, GraphPool, capture_graph
from asyncstep.gpu.host_stream import HostStream, HostStreamStatistics, switch_interval
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
