"""CUDA graphs: capture a callable once, replay it; and a CPU stand-in.

:func:`capture_graph` runs ``fn`` for warm-up, then captures it into a
:class:`CudaGraph` whose replay re-runs the recorded kernels on the same
memory (``fn``'s inputs must be static buffers, refilled before each replay;
its output tensors are the same ones every replay). Graphs captured with one
:class:`GraphPool` share one private memory pool: capture the largest first,
and the smaller ones reuse what it reserved (only one replays at a time, in
stream order).

On the CPU (or to test the wiring without a GPU) :class:`EagerGraph` stands
in: replaying calls ``fn`` again, which on static buffers computes what a
real replay would.

May import torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

__all__ = ["CudaGraph", "EagerGraph", "Graph", "GraphPool", "capture_graph"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Graph(Protocol[T_co]):
    def replay(self) -> T_co: ...


class GraphPool:
    """One memory pool shared by every graph of a model (None on the CPU)."""

    def __init__(self, device: torch.device, stand_in: bool = False) -> None:
        self.device = device
        self.stand_in = stand_in or device.type != "cuda"
        self.handle = None if self.stand_in else torch.cuda.graph_pool_handle()
        self.num_graphs = 0


class CudaGraph(Generic[T]):
    """A captured ``torch.cuda.CUDAGraph`` and the output its kernels write."""

    def __init__(self, graph: torch.cuda.CUDAGraph, output: T) -> None:
        self.graph = graph
        self.output = output

    def replay(self) -> T:
        self.graph.replay()
        return self.output


class EagerGraph(Generic[T]):
    """The CPU stand-in: replay runs ``fn`` again."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn

    def replay(self) -> T:
        return self.fn()


def capture_graph(fn: Callable[[], T], pool: GraphPool, *, warmup: int = 1) -> Graph[T]:
    """Warm ``fn`` up (lazy initialisation, Triton compilation, allocator
    growth stay out of the graph), then capture it into ``pool``.

    Capture is thread-local: other threads may keep using the device (their
    work is not recorded), but this thread must make no synchronising call
    inside ``fn``."""
    pool.num_graphs += 1
    if pool.stand_in:
        return EagerGraph(fn)
    stream = torch.cuda.Stream(pool.device)
    stream.wait_stream(torch.cuda.current_stream(pool.device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(pool.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.handle, capture_error_mode="thread_local"):
        output = fn()
    return CudaGraph(graph, output)
