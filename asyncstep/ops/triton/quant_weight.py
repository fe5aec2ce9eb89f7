"""Weights kept 4-bit (or 8-bit) on the GPU, as linear layers' packed
copies: :class:`GpuQ4Weight` (a GGUF's Q4_0 / Q4_1 weight, dequantized,
packed back into :mod:`asyncstep.ops.triton.quant`'s layout, scales and
offsets in float16 as GGUF stores them) and :class:`GpuQ8Weight` (a Q8_0
LM head); each carries its matmul (the Q4 / Q8 GEMV) for steps of at most
``max_tokens`` rows; :func:`pack_q4_gpu` / :func:`pack_q8_gpu` detect and
pack (None where a weight is not exactly on the grid).

May import torch, triton (on use), :mod:`asyncstep.ops.packed` and the
Triton quantized kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from asyncstep.ops.packed import GROUP_SIZE, PackedWeight, _int4_grid, is_int8_blocks

__all__ = ["GpuQ4Weight", "GpuQ8Weight", "pack_q4_gpu", "pack_q8_gpu"]


@dataclass
class GpuQ4Weight(PackedWeight):
    """A ``[out_features, in_features]`` weight kept as Q4 on the GPU:
    ``data`` is the packed codes (uint8 ``[out, in / 2]``), ``scales`` the
    float16 ``[out, in / 32, 2]`` scale and offset of each block
    (:mod:`asyncstep.ops.triton.quant`'s layout). Steps of at most
    ``max_tokens`` rows on its device use it."""

    KIND: ClassVar[str] = "q4_gpu"
    #: The rows of two stacked halves interleaved (:meth:`interleave_halves`).
    interleaved: bool = False

    def applies(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        return rows <= self.max_tokens and x.device == self.data.device

    def mm(self, x: torch.Tensor, *, int8_x: bool = False) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, in_features]``, in ``x``'s dtype
        (``int8_x``: a 16-bit ``x`` quantized per block to int8 in the GEMV,
        :func:`~asyncstep.ops.triton.quant.q4_gemv`)."""
        from asyncstep.ops.triton.quant import q4_matmul

        out = q4_matmul(x, self.data, self.scales, int8_x=int8_x)
        if self.interleaved:  # back to the halves stacked
            half = out.shape[-1] // 2
            out = out.unflatten(-1, (half, 2)).transpose(-1, -2).reshape(out.shape)
        return out

    def interleave_halves(self) -> None:
        """Reorder the packed rows (once) so that rows ``2 j, 2 j + 1`` are
        the two stacked halves' rows ``j`` (a ``gate_up_proj``'s gate and up:
        what :func:`~asyncstep.ops.triton.quant.q4_gemv_fused`'s
        ``silu_pairs`` reads); :meth:`mm` still returns the halves stacked."""
        from asyncstep.ops.triton.quant import interleave_pairs

        if not self.interleaved:
            self.data, self.scales = interleave_pairs(self.data, self.scales)
            self.interleaved = True


@dataclass
class GpuQ8Weight(GpuQ4Weight):
    """:class:`GpuQ4Weight` for 8-bit codes: ``data`` is uint8 ``[out, in]``
    (:func:`asyncstep.ops.triton.quant.pack_q8`'s layout)."""

    KIND: ClassVar[str] = "q8_gpu"

    def mm(self, x: torch.Tensor, *, int8_x: bool = False) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, in_features]``, in ``x``'s dtype
        (``int8_x``: as :meth:`GpuQ4Weight.mm`'s)."""
        from asyncstep.ops.triton.quant import q8_matmul

        return q8_matmul(x, self.data, self.scales, int8_x=int8_x)


def pack_q8_gpu(weight: torch.Tensor, max_tokens: int | None = None) -> GpuQ8Weight | None:
    """``weight`` (float32 ``[out, in]``, on its device) as :class:`GpuQ8Weight`
    for steps of at most ``max_tokens`` rows (default
    :data:`~asyncstep.ops.triton.quant.GEMV_MAX_M`), or None when it is not
    exactly 8-bit per block of 32 with float16 scales
    (:func:`~asyncstep.ops.packed.is_int8_blocks`)."""
    from asyncstep.ops.triton.quant import GEMV_MAX_M, pack_q8

    out_features, in_features = weight.shape
    if weight.numel() == 0 or not is_int8_blocks(weight):
        return None
    blocks = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    scale = blocks.abs().amax(dim=-1) / 127
    half = scale.half()
    if not bool(torch.isfinite(half).all()) or not torch.equal(half.float(), scale):
        return None
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(blocks / safe.unsqueeze(-1)).to(torch.int64)
    qweight, scales = pack_q8(codes.reshape(out_features, in_features), half)
    return GpuQ8Weight(
        GpuQ8Weight.KIND,
        qweight,
        scales,
        out_features,
        in_features,
        max_tokens=GEMV_MAX_M if max_tokens is None else max_tokens,
    )


def pack_q4_gpu(weight: torch.Tensor, max_tokens: int | None = None) -> GpuQ4Weight | None:
    """``weight`` (float32 ``[out, in]``, on its device) as :class:`GpuQ4Weight`
    for steps of at most ``max_tokens`` rows (default
    :data:`~asyncstep.ops.triton.quant.GEMV_MAX_M`), or None when it is not
    exactly 4-bit per block of 32, or a block's scale or offset overflows
    float16."""
    from asyncstep.ops.triton.quant import GEMV_MAX_M, pack_q4

    out_features, in_features = weight.shape
    if weight.dtype != torch.float32 or in_features % GROUP_SIZE or weight.numel() == 0:
        return None
    found = _int4_grid(weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE))
    if found is None:
        return None
    codes, scale, zero = found
    offset = zero - 8 * scale  # w = (q - 8) * scale + zero = q * scale + offset
    qweight, scales = pack_q4(codes.reshape(out_features, in_features), scale, offset)
    if not bool(torch.isfinite(scales).all()):
        return None
    return GpuQ4Weight(
        GpuQ4Weight.KIND,
        qweight,
        scales,
        out_features,
        in_features,
        max_tokens=GEMV_MAX_M if max_tokens is None else max_tokens,
    )
