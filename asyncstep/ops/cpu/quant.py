"""Weights kept in GGUF's blocks on the CPU, for the library's quantized
matmuls (``cpu_quant.c``, loaded by
:func:`~asyncstep.ops.cpu.library.load_cpu_kernels`).

A weight that is exactly Q4_0 / Q4_1 (4-bit codes, a scale and an offset per
block of 32 input features) or Q8_0 (8-bit codes, a scale per block) is
re-laid out at load as the kernel reads it: 16 output rows interleaved,
float16 scales and offsets after each block's codes (``cpu_quant.c`` says
how). No value changes: the kernel reproduces every weight exactly. Steps
of at most ``max_tokens`` rows use it; the activations are quantized per
block of 32 to int8 on the way in (as llama.cpp's), which is the kernel's
only rounding beyond the float32 sums.

:class:`CpuQuantWeight` is the packed copy and its matmul;
:func:`pack_q4_cpu` / :func:`pack_q8_cpu` detect and pack. Imports torch
and the packed weights' grid detection only.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass
from typing import ClassVar

import torch

from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.packed import (
    _ON_GRID_RTOL,
    GROUP_SIZE,
    PackedWeight,
    _codes,
    _int4_grid,
)

__all__ = ["QUANT_DTYPES", "CpuQuantMatmul", "CpuQuantWeight", "pack_q4_cpu", "pack_q8_cpu"]

#: Output rows interleaved in the packed layout (one float32 vector).
ROWS_PER_GROUP = 16
QUANT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_KINDS = {"q4_cpu": 0, "q8_cpu": 1}
#: The C side's ``QMatmulArgs``: 8 bytes per field, pointers as integers.
_ARGS = struct.Struct(
    "<q"  # kind
    "q"  # packed weight
    "qq"  # out_features, in_features
    "q"  # dtype of x
    "qq"  # x, row stride
    "qqq"  # out, row stride, dtype
    "q"  # rows
    "q"  # activation levels (1 or 2)
    "q"  # threads
)


#: ``asyncstep_qmatmul_fast()``'s answer: which build the matmul runs.
_ISAS = {0: "plain C", 1: "AVX512-VNNI", 2: "AVX2"}


class CpuQuantMatmul:
    """The library's quantized matmul (``asyncstep_qmatmul``)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._matmul = library.asyncstep_qmatmul
        self._matmul.argtypes = [ctypes.c_char_p]
        self._matmul.restype = ctypes.c_int
        #: The build the kernel runs (``cpu_quant.h``'s ``QMATMUL_ISA_*``).
        self.isa = _ISAS[int(library.asyncstep_qmatmul_fast())]
        #: Whether that is a vector build (else plain C: exact, slow).
        self.fast = self.isa != "plain C"
        self.block_bytes = {
            kind: int(library.asyncstep_qmatmul_block_bytes(code)) for kind, code in _KINDS.items()
        }

    def __call__(
        self, weight: CpuQuantWeight, x: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, in_features]`` (float32 or
        bfloat16, unit stride within a row), in ``out_dtype`` (None: x's)."""
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in QUANT_DTYPES:
            raise ValueError("x must be float32 or bfloat16 rows (unit stride within a row)")
        if x.shape[1] != weight.in_features:
            raise ValueError(f"x has {x.shape[1]} features, the weight {weight.in_features}")
        rows = x.shape[0]
        out = torch.empty(rows, weight.out_features, dtype=out_dtype or x.dtype)
        if rows == 0:
            return out
        args = _ARGS.pack(
            _KINDS[weight.kind],
            weight.data.data_ptr(),
            weight.out_features,
            weight.in_features,
            QUANT_DTYPES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            QUANT_DTYPES[out.dtype],
            rows,
            weight.levels,
            torch.get_num_threads(),
        )
        if self._matmul(args) != 0:
            raise MemoryError("the quantized matmul found no scratch memory")
        return out


@dataclass
class CpuQuantWeight(PackedWeight):
    """A ``[out_features, in_features]`` weight in the kernel's layout:
    ``data`` uint8 ``[ceil(out / 16), in / 32, block bytes]``; ``scales``
    an empty tensor of the model's dtype (the scales live in ``data``).
    Steps of at most ``max_tokens`` rows of that dtype use it."""

    KINDS: ClassVar[tuple[str, ...]] = tuple(_KINDS)

    @staticmethod
    def block_bytes(kind: str) -> int:
        """Bytes of ``data`` per 16 rows x 32 inputs (:func:`_finish`'s
        layout): the codes (4 or 8 bits each), then 16 float16 scales and 16
        float16 offsets."""
        code_bits = 4 if kind == "q4_cpu" else 8
        return ROWS_PER_GROUP * GROUP_SIZE * code_bits // 8 + 2 * ROWS_PER_GROUP * 2

    #: Activation codes per value: 1 (int8, as llama.cpp) or 2 (the
    #: remainder too, at 1/256 of the first scale: one ~15-bit code, twice
    #: the integer products).
    levels: int = 2

    def applies(self, x: torch.Tensor) -> bool:
        """As the packed weights', and only where the library runs its
        vector build (it is built on the first call); else the dense weight."""
        return super().applies(x) and self.runs_here()

    def runs_here(self) -> bool:
        """Whether the library's vector build runs here (building it, once
        per machine, on the first call)."""
        return _fast_library() is not None

    def mm(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The product, by the library (its plain C path where the CPU has
        no vector build: correct, slower than the dense weight, which
        :meth:`applies` then prefers), in ``out_dtype`` (None: x's)."""
        matmul = quant_matmul()
        assert matmul is not None, "a CPU-quantized weight needs the CPU library"
        return matmul(self, x, out_dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`mm` in float32 (the library's sums, not rounded)."""
        return self.mm(x, torch.float32)


@functools.cache
def quant_matmul() -> CpuQuantMatmul | None:
    """The library's quantized matmul (the library built on first use);
    None where the library is off or does not build."""
    kernels = load_cpu_kernels()
    return None if kernels is None else CpuQuantMatmul(kernels.library)


def _fast_library() -> CpuQuantMatmul | None:
    """:func:`quant_matmul` where it runs a vector build (AVX512-VNNI or AVX2)."""
    matmul = quant_matmul()
    return matmul if matmul is not None and matmul.fast else None


def pack_q4_cpu(
    weight: torch.Tensor, dtype: torch.dtype, max_tokens: int, levels: int = 2
) -> CpuQuantWeight | None:
    """``weight`` (float32 ``[out, in]``) in the Q4 layout, or None when it
    is not exactly 4-bit per block (or a scale or offset is not float16)."""
    if not _packable(weight):
        return None
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    found = _q4_1_blocks(blocks)  # a GGUF's Q4_1, in one pass
    if found is None:  # Q4_0, or a mix: the general detection
        grid = _int4_grid(blocks)
        if grid is None:
            return None
        codes, scale, zero = grid  # w = (q - 8) * scale + zero = q * scale + offset
        general = _as_halves(weight, codes, scale, zero - 8 * scale)
        if general is None:
            return None
        halves = general
    else:
        codes, halves = found
    codes = _grouped(codes.reshape(out_features, in_features))  # [G, B, 16, 32]
    # Vector c (0..3), lane r, byte i: code 4c + i in the low nibble, 16 + 4c + i in the high.
    low = codes[..., :16].reshape(*codes.shape[:3], 4, 4).transpose(2, 3)
    high = codes[..., 16:].reshape(*codes.shape[:3], 4, 4).transpose(2, 3)
    packed_codes = (low | (high << 4)).flatten(2)
    return _finish("q4_cpu", packed_codes, halves, weight.shape, dtype, max_tokens, levels)


def pack_q8_cpu(
    weight: torch.Tensor, dtype: torch.dtype, max_tokens: int, levels: int = 2
) -> CpuQuantWeight | None:
    """``weight`` (float32 ``[out, in]``) in the Q8 layout, or None when it is
    not exactly 8-bit per block (a GGUF's Q8_0: w = d * q, |q| <= 127, d the
    block's largest magnitude / 127 in float16)."""
    if not _packable(weight):
        return None
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    amax = blocks.abs().amax(dim=-1)
    d = (amax / 127).to(torch.float16)
    if not bool(torch.isfinite(d).all()):
        return None
    codes = _codes(blocks, d.float())
    if bool((codes.abs() > 127).any()):
        return None
    if not _rebuilds(blocks, codes, d.float(), 0.0, amax):
        return None
    halves = (d, (-128 * d.float()).to(torch.float16))  # w = d * (u - 128)
    codes = (codes + 128).to(torch.uint8)
    codes = _grouped(codes.reshape(out_features, in_features))  # [G, B, 16, 32]
    # Vector j (0..7), lane r, byte i: code 4j + i.
    packed_codes = codes.reshape(*codes.shape[:3], 8, 4).transpose(2, 3).flatten(2)
    return _finish("q8_cpu", packed_codes, halves, weight.shape, dtype, max_tokens, levels)


def _q4_1_blocks(
    blocks: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None:
    """Codes ``[out, B, 32]`` (uint8) and float16 (scale, offset) ``[out, B]``
    of blocks that are exactly Q4_1 (w = q * d + m, m the block's minimum and
    d its range / 15, both float16), or None when one block is not."""
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d, m = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    if not bool(torch.isfinite(d).all() and torch.isfinite(m).all()):
        return None
    d32, m32 = d.float(), m.float()
    codes = _codes(blocks - m32.unsqueeze(-1), d32).clamp_(0, 15)
    amax = torch.maximum(lo.abs(), hi.abs())
    if not _rebuilds(blocks, codes, d32, m32, amax):
        return None
    return codes.to(torch.uint8), (d, m)


def _rebuilds(
    blocks: torch.Tensor,
    codes: torch.Tensor,
    d: torch.Tensor,
    m: torch.Tensor | float,
    amax: torch.Tensor,
) -> bool:
    """Whether ``codes * d + m`` gives back every value of ``blocks`` (to a
    few float32 rounding steps of its block's largest magnitude)."""
    rebuilt = codes * d.unsqueeze(-1)
    if isinstance(m, torch.Tensor):
        rebuilt += m.unsqueeze(-1)
    tol = _ON_GRID_RTOL * amax.unsqueeze(-1) + 1e-30
    return bool((rebuilt.sub_(blocks).abs_() <= tol).all())


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.shape[1] % GROUP_SIZE == 0
        and weight.numel() > 0
    )


def _grouped(rows: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` (zero rows added up to a multiple of 16) as ``[G, B, 16, 32]``."""
    out_features, in_features = rows.shape
    pad = -out_features % ROWS_PER_GROUP
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, in_features)])
    groups = rows.shape[0] // ROWS_PER_GROUP
    return rows.reshape(groups, ROWS_PER_GROUP, in_features // GROUP_SIZE, GROUP_SIZE).transpose(
        1, 2
    )


def _as_halves(
    weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each block's scale and offset ``[out, B]`` as float16, when ``codes *
    scale + offset`` with them gives back ``weight`` (to a few float32
    rounding steps of the block's largest magnitude, as the GGUF's
    dequantization left it); else None."""
    d, m = scale.to(torch.float16), offset.to(torch.float16)
    if not bool(torch.isfinite(d).all() and torch.isfinite(m).all()):
        return None
    blocks = weight.reshape(codes.shape)
    rebuilt = codes.float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)
    tol = _ON_GRID_RTOL * blocks.abs().amax(dim=-1, keepdim=True) + 1e-30
    if not bool(((rebuilt - blocks).abs() <= tol).all()):
        return None
    return d, m


def _finish(
    kind: str,
    packed_codes: torch.Tensor,
    halves: tuple[torch.Tensor, torch.Tensor],
    shape: torch.Size,
    dtype: torch.dtype,
    max_tokens: int,
    levels: int,
) -> CpuQuantWeight:
    """Codes ``[G, B, code bytes]`` with each block's 16 float16 scales and
    then offsets appended."""
    parts = [_grouped_rows(half).view(torch.uint8) for half in halves]
    data = torch.cat([packed_codes, *parts], dim=-1).contiguous()
    out_features, in_features = shape
    return CpuQuantWeight(
        kind, data, torch.empty(0, dtype=dtype), out_features, in_features, max_tokens, levels
    )


def _grouped_rows(values: torch.Tensor) -> torch.Tensor:
    """Per-block values ``[out, B]`` as ``[G, B, 16]`` (zero rows added)."""
    out_features, blocks = values.shape
    pad = -out_features % ROWS_PER_GROUP
    if pad:
        values = torch.cat([values, values.new_zeros(pad, blocks)])
    return values.reshape(-1, ROWS_PER_GROUP, blocks).transpose(1, 2).contiguous()
