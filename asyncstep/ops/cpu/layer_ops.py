"""A decoder layer's non-matmul work on the CPU, in ``cpu_kernels.c``
(loaded by :func:`~asyncstep.ops.cpu.library.load_cpu_kernels`):
the residual add with RMSNorm over a float32 residual stream, and
``silu(gate) * up`` from a merged gate/up projection. One call each instead
of a chain of torch ops (and their dtype conversions); rows are spread over
threads only for large calls.

They return what the torch expressions they replace return
(:class:`~asyncstep.models.layers.norm.RMSNorm` in ``float32_residual``
mode; ``F.silu(gate) * up``), bit for bit on x86: the same float32
operations in the same order, i.e. the sum of squares in the order of
torch's sum kernel (its 8-lane x86 build), ``exp`` as SLEEF's ``expf_u10``
where torch's vector loop takes a row's values and libm's ``expf`` on the
rest, and bfloat16 rounding where torch rounds (silu, then the product). A
greedy token on a near tie so comes out as it does without them. Two
limits: where torch's vectors are of another width than
:func:`torch_vector_bytes` says, or a row's silu width is not a multiple of
128 values and torch splits a large call among threads, a few values take
the other ``exp``; and elsewhere than x86 the sum's order may differ. Then
the results are within a few float32 ulps before the output's rounding: one
ulp of a bfloat16 output.
"""

from __future__ import annotations

import ctypes
import struct

import torch

__all__ = ["LAYER_OP_DTYPES", "CpuLayerOps"]

LAYER_OP_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

#: The C side's ``NormArgs`` and ``SiluArgs``: the arguments of a call packed
#: into one struct (ctypes converts each argument separately, a cost paid on
#: every call), 8 bytes per field, pointers as integers (0: NULL).
_NORM_ARGS = struct.Struct(
    "<q"  # dtype of x and out
    "qq"  # out, row stride
    "qq"  # x, row stride
    "qq"  # residual (NULL: the stream starts at x), row stride
    "qq"  # residual_out (NULL: not stored; may be residual), row stride
    "q"  # weight
    "qqq"  # rows, vectors per row (groups), hidden
    "d"  # eps
    "q"  # threads
)
_SILU_ARGS = struct.Struct(
    "<q"  # dtype
    "qq"  # out, row stride
    "qq"  # gate_up, row stride
    "qq"  # rows, d (out's width; gate_up's is 2 * d)
    "q"  # bytes of torch's vectors
    "q"  # threads
)


class CpuLayerOps:
    """The layer ops of a loaded library. Inputs are rows: ``[rows, width]``
    tensors on the CPU with unit stride in the last dimension (any row
    stride), float32 or bfloat16 (see :meth:`takes`); outputs are new
    contiguous tensors unless stated."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._norm = library.asyncstep_add_rms_norm
        self._silu = library.asyncstep_silu_and_mul
        for fn in (self._norm, self._silu):
            fn.argtypes = [ctypes.c_char_p]
            fn.restype = None
        self._vector_bytes = torch_vector_bytes()

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether ``x`` is rows the ops take (else the caller runs torch's)."""
        return x.dim() == 2 and x.is_cpu and x.dtype in LAYER_OP_DTYPES and x.stride(1) == 1

    @staticmethod
    def takes_vectors(x: torch.Tensor) -> bool:
        """Whether :meth:`rms_norm` takes ``x``: rows, or ``[rows, groups,
        hidden]`` whose groups are contiguous within a row."""
        if x.dim() == 3 and x.stride(1) == x.shape[2]:
            return CpuLayerOps.takes(x.select(1, 0))
        return CpuLayerOps.takes(x)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        *,
        in_place: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(r) * weight in x's dtype, r)`` for ``r = residual + x``
        in float32 (``r = x`` widened when ``residual`` is None). ``residual``:
        float32 rows of x's shape; with ``in_place`` it becomes ``r`` (and is
        returned), else ``r`` is a new tensor and ``residual`` is not
        modified. ``weight``: contiguous float32 ``[hidden]``."""
        rows, hidden, x_stride = _rows(x, "x")
        _check_weight(weight, hidden)
        out = torch.empty(rows, hidden, dtype=x.dtype)
        res_ptr = res_stride = 0
        if residual is not None:
            if residual.dtype != torch.float32 or residual.shape != x.shape:
                raise ValueError("the residual must be float32 rows of x's shape")
            res_stride = _rows(residual, "residual")[2]
            res_ptr = residual.data_ptr()
        if in_place:
            if residual is None:
                raise ValueError("in_place needs a residual to write")
            result = residual
        else:
            result = torch.empty(rows, hidden, dtype=torch.float32)
        args = _NORM_ARGS.pack(
            LAYER_OP_DTYPES[x.dtype],
            out.data_ptr(),
            hidden,
            x.data_ptr(),
            x_stride,
            res_ptr,
            res_stride,
            result.data_ptr(),
            result.stride(0),
            weight.data_ptr(),
            rows,
            1,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        self._norm(args)
        return out, result

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x) * weight`` over the last dimension, in float32,
        rounded to x's dtype; ``x`` as :meth:`takes_vectors` says (per-head
        norms of a projection's output are the grouped form)."""
        if not self.takes_vectors(x):
            raise ValueError("x must be float32 or bfloat16 rows (or row groups) on the CPU")
        rows, groups, hidden = (x.shape[0], 1, x.shape[1]) if x.dim() == 2 else x.shape
        _check_weight(weight, hidden)
        out = torch.empty(x.shape, dtype=x.dtype)
        args = _NORM_ARGS.pack(
            LAYER_OP_DTYPES[x.dtype],
            out.data_ptr(),
            groups * hidden,
            x.data_ptr(),
            x.stride(0),
            0,
            0,
            0,
            0,
            weight.data_ptr(),
            rows,
            groups,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        self._norm(args)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` rows of even width."""
        rows, width, in_stride = _rows(gate_up, "gate_up")
        if width % 2:
            raise ValueError("gate_up's width must be even: [gate | up]")
        d = width // 2
        out = torch.empty(rows, d, dtype=gate_up.dtype)
        args = _SILU_ARGS.pack(
            LAYER_OP_DTYPES[gate_up.dtype],
            out.data_ptr(),
            d,
            gate_up.data_ptr(),
            in_stride,
            rows,
            d,
            self._vector_bytes,
            torch.get_num_threads(),
        )
        self._silu(args)
        return out


def torch_vector_bytes() -> int:
    """The width of torch's CPU vectors (its ``Vectorized``) in this process:
    where its loops switch from vector to scalar code."""
    return 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32


def _rows(x: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(rows, width, row stride) of rows the ops take."""
    if not CpuLayerOps.takes(x):
        raise ValueError(f"{name} must be float32 or bfloat16 rows on the CPU (unit last stride)")
    rows, width = x.shape
    return rows, width, x.stride(0)


def _check_weight(weight: torch.Tensor, hidden: int) -> None:
    if (
        weight.dim() != 1
        or weight.shape[0] != hidden
        or weight.dtype != torch.float32
        or not weight.is_cpu
        or not weight.is_contiguous()
    ):
        raise ValueError(f"the norm's weight must be contiguous float32 [{hidden}] on the CPU")
