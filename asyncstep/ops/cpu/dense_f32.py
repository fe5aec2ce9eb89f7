"""The CPU library's matmul of a dense float32 weight (``cpu_dense_f32.c``,
loaded by :func:`~asyncstep.ops.cpu.library.load_cpu_kernels`): ``x @ w.T``
read from torch's own tensors (no copy), float32 in and out, one K order
for every output whatever the row count, the thread count or the build
(AVX-512, AVX2 + FMA and plain C give the same bits): a row's outputs are
the same whatever the other rows (issue 40). Its uses: every dense float32
projection of the CPU op set and the float32 LM head.
Imports torch and the library's bindings (:mod:`.bound_matmul`) only.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from asyncstep.ops.cpu.bound_matmul import BoundMatmul, bind_matmul

__all__ = ["CpuDenseF32Matmul", "dense_f32_matmul", "takes_float32"]

#: The C side's ``DenseF32Args``: 8 bytes per field, pointers as integers.
_ARGS = struct.Struct(
    "<q"  # weight
    "qqq"  # out_features, in_features, weight row stride
    "qq"  # x, its row stride
    "qq"  # out, its row stride
    "q"  # rows
    "q"  # threads
)
#: ``asyncstep_dense_f32_isa()``'s answer: which build runs.
_ISAS = {0: "plain C", 2: "AVX-512", 3: "AVX2"}


class CpuDenseF32Matmul(BoundMatmul):
    """The library's dense float32 matmul (``asyncstep_dense_f32``);
    :attr:`fast`: every build but plain C, which computes one output at a
    time."""

    def __init__(self, library: ctypes.CDLL) -> None:
        super().__init__(library, "asyncstep_dense_f32", _ISAS)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` in float32 for ``x`` ``[rows, K]`` and ``weight``
        ``[N, K]``, both float32 CPU tensors with unit stride within a row."""
        if not takes_float32(x, weight):
            raise ValueError(
                "the float32 matmul takes float32 CPU rows x [rows, K] and weight [N, K] "
                f"(unit stride within a row), got {tuple(x.shape)} {x.dtype} and "
                f"{tuple(weight.shape)} {weight.dtype}"
            )
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        args = _ARGS.pack(
            weight.data_ptr(),
            weight.shape[0],
            weight.shape[1],
            weight.stride(0),
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            torch.get_num_threads(),
        )
        if self._kernel(args) != 0:
            raise ValueError("the float32 matmul refused its shapes")
        return out


def takes_float32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the float32 matmul takes ``x @ weight.T``: 2-D float32 CPU
    tensors of one K, each with unit stride within a row (K >= 1)."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.shape[1] == weight.shape[1] >= 1
        and (x.stride(1) == 1 or x.shape[1] == 1)
        and (weight.stride(1) == 1 or weight.shape[1] == 1)
        and x.stride(0) >= x.shape[1]
        and weight.stride(0) >= weight.shape[1]
    )


@functools.cache
def dense_f32_matmul() -> CpuDenseF32Matmul | None:
    """The library's dense float32 matmul (the library built on first use);
    None where the library is off or does not build."""
    return bind_matmul(CpuDenseF32Matmul)
