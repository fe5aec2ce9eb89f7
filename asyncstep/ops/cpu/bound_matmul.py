"""What the CPU library's dense matmuls share on the Python side
(:mod:`~asyncstep.ops.cpu.dense`, :mod:`~asyncstep.ops.cpu.dense_f32`): the
kernel bound through ctypes (one struct of 8-byte fields in, 0 back on
success: ``self._kernel(args)``, called directly, no layer per call), the
build it runs (``<kernel>_isa()``), and the library loaded on first use.
Imports the library's loader only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import TypeVar

from asyncstep.ops.cpu.library import load_cpu_kernels

__all__ = ["BoundMatmul", "bind_matmul"]

Matmul = TypeVar("Matmul", bound="BoundMatmul")


class BoundMatmul:
    """A matmul of the library: ``kernel(const Args*)``, 0 on success, and
    ``kernel_isa()``, the build it runs (a key of ``isas``)."""

    def __init__(self, library: ctypes.CDLL, kernel: str, isas: Mapping[int, str]) -> None:
        self._kernel = getattr(library, kernel)
        self._kernel.argtypes = [ctypes.c_char_p]
        self._kernel.restype = ctypes.c_int
        #: The build the kernel runs.
        self.isa = isas[int(getattr(library, f"{kernel}_isa")())]
        #: Whether that build is blocked (tiles of rows of x by rows of W:
        #: every build but plain C); select_ops makes it the default where
        #: it is.
        self.fast = self.isa != "plain C"


def bind_matmul(matmul: Callable[[ctypes.CDLL], Matmul]) -> Matmul | None:
    """``matmul`` bound to the library (built on first use); None where the
    library is off or does not build."""
    kernels = load_cpu_kernels()
    return None if kernels is None else matmul(kernels.library)
