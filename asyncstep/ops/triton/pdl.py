"""Programmatic dependent launch (PDL) between the decode step's kernels.

A kernel launched with PDL (Triton's ``launch_pdl=True``) may start while
the kernel before it in the stream still runs, once every program of that
kernel has called :func:`launch_dependents` (or exited); it must call
:func:`wait_prior` before it reads anything the kernel before wrote, or
writes anything, and may do work that touches neither before (the Q4 GEMV
loads its first weights). A kernel that takes part has a ``PDL``
compile-time parameter, passed to both: with ``PDL`` false they compile to
nothing (the kernel is the one without PDL). :func:`launch_kwargs` is the
launcher's side: ``PDL=True`` and ``launch_pdl=True`` where :func:`applies`
(CUDA, compute capability 9.0 or above, not under the Triton interpreter,
:data:`ENABLED`), else ``PDL=False``.

Before its wait a kernel may read only what no kernel of the chain
writes: the weights, and the step's attention metadata (``query_start_loc``,
``seq_lens``, the block table), which the step writes before its first
kernel, by copies or by kernels launched without PDL (such a launch waits
for everything before it, and every PDL kernel after it starts later).
The GEMVs (Q4, :mod:`asyncstep.ops.triton.quant_kernels`; dense,
:mod:`asyncstep.ops.triton.gemv`) call :func:`launch_dependents` first
thing and :func:`wait_prior` once their first weights are loaded, so
consecutive GEMVs overlap one's drain with the next one's launch and first
loads; the decode attention's split and combine kernels
(:mod:`asyncstep.ops.triton.decode_kernels`) read their tokens' metadata
before the wait; the norms, SiLU and the mixture-of-experts kernels
(:mod:`asyncstep.ops.triton.fused`, ``moe_routing_kernels``,
``fused_moe_kernels``) wait first thing. A program waiting in :func:`wait_prior` holds
its SM slot: a kernel's dependents launch only once all its own programs
have started, so the running kernel never waits for a slot. Results are
the same bits with PDL or without (``tests/models/test_fused_decode.py``,
``tests/gpu/test_pdl_chain.py``).

May import torch and triton only.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = [
    "ENABLED",
    "applies",
    "launch_dependents",
    "launch_kwargs",
    "launch_then_wait",
    "wait_prior",
]

#: Whether the decode kernels use PDL where the GPU has it (``ASYNCSTEP_PDL=0``:
#: never; read once, at import; tests may set it).
ENABLED = os.environ.get("ASYNCSTEP_PDL") != "0"
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def applies(x: torch.Tensor) -> bool:
    """Whether a kernel on ``x``'s device launches with PDL."""
    return ENABLED and x.is_cuda and not _INTERPRETED and _has_pdl(x.device)


def launch_kwargs(x: torch.Tensor) -> dict[str, bool]:
    """A PDL kernel's launch keywords on ``x``'s device (see the module's docstring)."""
    return {"PDL": True, "launch_pdl": True} if applies(x) else {"PDL": False}


@triton.jit
def launch_dependents(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """Let the next kernel, if launched with PDL, start (see the module's docstring)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_prior(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """Wait until the kernel before has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_then_wait(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """Both, first thing: a kernel that reads nothing before its wait."""
    launch_dependents(PDL)
    wait_prior(PDL)
