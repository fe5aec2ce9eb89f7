"""The CPU library's matmul of a dense bfloat16 weight (``cpu_dense.c``,
loaded by :func:`~asyncstep.ops.cpu.library.load_cpu_kernels`):
``x @ w.T`` read from torch's own tensor (no copy), in float32 sums written
as float32 or bfloat16, one K order for every row count (a row's outputs
are the same whatever the other rows: issue 40). Its uses: every dense
bfloat16 projection of the CPU op set, and the float32 logits of a
bfloat16 LM head.
Imports torch, the library's bindings (:mod:`.bound_matmul`) and the CPU's flags.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from asyncstep.cpu_features import cpu_flags
from asyncstep.ops.cpu.bound_matmul import BoundMatmul, bind_matmul

__all__ = ["CpuDenseMatmul", "dense_matmul"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: The C side's ``DenseMatmulArgs``: 8 bytes per field, pointers as integers.
_ARGS = struct.Struct(
    "<q"  # weight
    "qqq"  # out_features, in_features, weight row stride
    "qqq"  # x, its dtype, row stride
    "qqq"  # out, its dtype, row stride
    "q"  # rows
    "q"  # threads
    "q"  # outer_min_rows (0: the build's)
)
#: The AVX512-BF16 build's outer products from this many rows where the CPU
#: has AMX (an Intel Xeon of that generation: 1.4-1.5x the dot tiles from 8
#: rows there, ``benchmarks/results/cpu/dense_outer_1206/``); elsewhere the
#: build's own threshold (32, measured on Zen 4).
AMX_OUTER_MIN_ROWS = 4
#: ``asyncstep_dense_matmul_isa()``'s answer: which build runs.
_ISAS = {0: "plain C", 1: "AVX512-BF16", 2: "AVX512F", 3: "AVX2"}


class CpuDenseMatmul(BoundMatmul):
    """The library's dense bfloat16 matmul (``asyncstep_dense_matmul``);
    :attr:`fast`: every build but plain C, which computes a row at a time."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "asyncstep_dense_matmul", _ISAS)
        #: Where the outer products start (0: the build's own threshold).
        self.outer_min_rows = AMX_OUTER_MIN_ROWS if "amx_bf16" in cpu_flags() else 0

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``x @ weight.T`` for ``x`` ``[rows, K]`` (float32 or bfloat16,
        unit stride within a row) and ``weight`` ``[N, K]`` bfloat16 (unit
        stride within a row), in ``out_dtype``."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _DTYPES:
            raise ValueError("x must be float32 or bfloat16 rows (unit stride within a row)")
        if weight.dim() != 2 or weight.stride(1) != 1 or weight.dtype != torch.bfloat16:
            raise ValueError("the weight must be bfloat16 rows (unit stride within a row)")
        if x.shape[1] != weight.shape[1]:
            raise ValueError(f"x has {x.shape[1]} features, the weight {weight.shape[1]}")
        if x.device.type != "cpu" or weight.device.type != "cpu":
            raise ValueError("the CPU library's matmul takes CPU tensors")
        out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
        args = _ARGS.pack(
            weight.data_ptr(),
            weight.shape[0],
            weight.shape[1],
            weight.stride(0),
            x.data_ptr(),
            _DTYPES[x.dtype],
            x.stride(0),
            out.data_ptr(),
            _DTYPES[out_dtype],
            out.stride(0),
            x.shape[0],
            torch.get_num_threads(),
            self.outer_min_rows,
        )
        if self._kernel(args) != 0:
            raise MemoryError("the dense matmul found no scratch memory")
        return out


@functools.cache
def dense_matmul() -> CpuDenseMatmul | None:
    """The library's dense bfloat16 matmul (the library built on first use);
    None where the library is off or does not build."""
    return bind_matmul(CpuDenseMatmul)
