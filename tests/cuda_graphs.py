"""What the GPU tests of the Triton kernels share: a function's CUDA graph
(warmed up on a side stream, then captured), and programmatic dependent
launch's check (a chain of kernels gives, with PDL, the bits it gives
without). Needs a CUDA device when called; imports nothing else of the
tests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def captured(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn`` run once on a side stream (its warm-up), then captured: the
    graph and the tensor its replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def pdl_off_bits(
    chain: Callable[[], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    """``chain()`` with PDL off; then, with PDL on (left on), three eager
    runs give those bits."""
    from asyncstep.ops.triton import pdl

    monkeypatch.setattr(pdl, "ENABLED", False)
    expected = chain()
    monkeypatch.setattr(pdl, "ENABLED", True)
    for _ in range(3):
        assert torch.equal(chain(), expected)
    return expected
