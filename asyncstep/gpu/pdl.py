"""Programmatic dependent launch (PDL) between the decode step's kernels.

A kernel launched with PDL (Triton's ``launch_pdl=True``) may start while
the kernel before it in the stream still runs, once every program of that
kernel has called :func:`launch_dependents` (or exited); it must call
:func:`wait_prior` before it reads anything the kernel before wrote, or
writes anything, and may do work that touches neither before (the Q4 GEMV
loads its first weights). Both are no-ops for a kernel launched without
PDL, and compile to nothing where :data:`ENABLED` is false: under the
Triton interpreter (``TRITON_INTERPRET=1``), which cannot run them, or with
``ASYNCSTEP_PDL=0``.

May import triton only.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["ENABLED", "launch_dependents", "wait_prior"]

#: Whether kernels use PDL (read once, at import).
ENABLED = os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("ASYNCSTEP_PDL") != "0"
_ENABLED: tl.constexpr = tl.constexpr(ENABLED)


@triton.jit
def launch_dependents():  # type: ignore[no-untyped-def]
    """Let the next kernel, if launched with PDL, start (see the module's docstring)."""
    if _ENABLED:
        gdc_launch_dependents()


@triton.jit
def wait_prior():  # type: ignore[no-untyped-def]
    """Wait until the kernel before has completed and its writes are visible."""
    if _ENABLED:
        gdc_wait()
