"""The packed layouts of weights kept 4-bit (or 8-bit) on the GPU: GGUF's
Q4_0 / Q4_1 (Q8_0) blocks as packed codes with per-block scales, how to
build them, and their torch references.

The layout (``Q4``) of an ``[N, K]`` weight, ``K`` a multiple of
:data:`GROUP_SIZE`, in blocks of 32 input features:

- ``qweight``: uint8 ``[N, K // 2]``, read as int32 words: word ``t`` (0..3,
  little-endian bytes ``4t..4t+3``) of block ``b`` of a row holds in its
  nibble ``s`` (bits ``4s..4s+3``, 0..7) the code of feature
  ``32 b + 4 s + t``. (Not GGUF's own order: this one lets a kernel turn a
  code into a float with one AND, and read the four features of a nibble
  position from consecutive inputs.)
- ``scales``: float16 ``[N, K // 32, 2]``: per block its scale ``d`` and its
  offset ``m``: ``w = q * d + m`` (a Q4_1 block as stored; a Q4_0 block has
  ``m = -8 d``), computed in float32.

The 8-bit layout (``Q8``) is the same with bytes for nibbles: ``qweight``
uint8 ``[N, K]``, word ``t`` (0..7) of a block holds in its byte ``s``
(0..3) the code of feature ``32 b + 8 s + t`` plus 128 (0..255), and
``scales`` holds ``(d, -128 d)`` (a Q8_0 block: ``w = (q - 128) d``).

:func:`pack_q4` / :func:`pack_q8` build the layouts from codes and scales;
:func:`dequantize_q4_reference` / :func:`dequantize_q8_reference` are the
torch references (float32).

:func:`interleave_pairs` reorders a stacked two-halves weight's rows in
pairs (the fused decode's SiLU·mul epilogue holds a gate row and its up
row in one program).

The Triton kernels that multiply by these layouts, and their launchers, are
:mod:`asyncstep.ops.triton.quant`'s.

May import torch only.
"""

from __future__ import annotations

import torch

__all__ = [
    "GROUP_SIZE",
    "dequantize_q4_reference",
    "dequantize_q8_reference",
    "interleave_pairs",
    "pack_q4",
    "pack_q8",
]

#: Input features per block (GGUF's Q4_0 / Q4_1 block).
GROUP_SIZE = 32


def pack_q4(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales)`` in the module's layout for ``w = codes * scale +
    offset``: ``codes`` ``[N, K]`` integers in [0, 15], ``scale`` and
    ``offset`` ``[N, K // 32]`` (rounded to float16). On ``codes``' device."""
    if codes.dim() != 2 or codes.shape[1] % GROUP_SIZE:
        raise ValueError(f"codes must be [N, K] with K a multiple of 32, got {tuple(codes.shape)}")
    n, k = codes.shape
    groups = k // GROUP_SIZE
    if scale.shape != (n, groups) or offset.shape != (n, groups):
        raise ValueError(
            f"scale {tuple(scale.shape)} and offset {tuple(offset.shape)} must be ({n}, {groups})"
        )
    # Feature 4 s + t of a block -> [s, t]; byte 4 t + c holds s = 2c (low), 2c + 1 (high).
    by_position = codes.reshape(n, groups, 8, 4).to(torch.uint8)
    low, high = by_position[:, :, 0::2], by_position[:, :, 1::2]  # [n, groups, c, t]
    qweight = (low | (high << 4)).transpose(2, 3).reshape(n, k // 2).contiguous()
    scales = torch.stack([scale, offset], dim=-1).to(torch.float16).contiguous()
    return qweight, scales


def dequantize_q4_reference(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of ``(qweight, scales)`` (torch ops)."""
    n, half_k = qweight.shape
    groups = half_k * 2 // GROUP_SIZE
    by_byte = qweight.reshape(n, groups, 4, 4)  # [n, groups, t, c]
    nibbles = torch.stack([by_byte & 15, by_byte >> 4], dim=-1)  # [..., t, c, low/high]
    codes = nibbles.reshape(n, groups, 4, 8).transpose(2, 3).float()  # [n, groups, s, t]
    d, m = scales.float().unbind(-1)
    w = codes.reshape(n, groups, GROUP_SIZE) * d.unsqueeze(-1) + m.unsqueeze(-1)
    return w.reshape(n, groups * GROUP_SIZE)


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales)`` in the 8-bit layout (the module's docstring) for
    ``w = codes * scale``: ``codes`` ``[N, K]`` integers in [-128, 127],
    ``scale`` ``[N, K // 32]`` (rounded to float16). On ``codes``' device."""
    if codes.dim() != 2 or codes.shape[1] % GROUP_SIZE:
        raise ValueError(f"codes must be [N, K] with K a multiple of 32, got {tuple(codes.shape)}")
    n, k = codes.shape
    groups = k // GROUP_SIZE
    if scale.shape != (n, groups):
        raise ValueError(f"scale {tuple(scale.shape)} must be ({n}, {groups})")
    # Feature 8 s + t of a block -> byte 4 t + s (byte s of word t).
    by_position = (codes.reshape(n, groups, 4, 8) + 128).to(torch.uint8)
    qweight = by_position.transpose(2, 3).reshape(n, k).contiguous()
    d = scale.to(torch.float16)
    scales = torch.stack([d, d * -128], dim=-1).contiguous()
    return qweight, scales


def dequantize_q8_reference(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of an 8-bit ``(qweight, scales)`` (torch ops)."""
    n, k = qweight.shape
    groups = k // GROUP_SIZE
    codes = qweight.reshape(n, groups, 8, 4).transpose(2, 3).float()  # [n, groups, s, t]
    d, m = scales.float().unbind(-1)
    w = codes.reshape(n, groups, GROUP_SIZE) * d.unsqueeze(-1) + m.unsqueeze(-1)
    return w.reshape(n, k)


def _check_weight(qweight: torch.Tensor, scales: torch.Tensor, bits: int = 4) -> tuple[int, int]:
    """``(N, blocks per row)`` of a checked ``(qweight, scales)`` pair of
    ``bits``-bit codes."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or not qweight.is_contiguous():
        raise ValueError(
            f"qweight must be a contiguous uint8 [N, K * {bits} / 8], got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    n, row_bytes = qweight.shape
    block_bytes = GROUP_SIZE * bits // 8
    if row_bytes % block_bytes:
        raise ValueError(f"qweight's row of {row_bytes} bytes must be a multiple of {block_bytes}")
    groups = row_bytes // block_bytes
    if scales.shape != (n, groups, 2) or scales.dtype != torch.float16:
        raise ValueError(
            f"scales must be float16 ({n}, {groups}, 2), got {scales.dtype} {tuple(scales.shape)}"
        )
    if not scales.is_contiguous():
        raise ValueError("scales must be contiguous")
    if qweight.device != scales.device:
        raise ValueError(f"qweight on {qweight.device}, scales on {scales.device}")
    return n, groups


def interleave_pairs(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A ``[2 d, K]`` packed weight of two stacked halves (gate rows, then up
    rows) with rows ``2 j, 2 j + 1`` the halves' rows ``j`` (new tensors)."""
    n = qweight.shape[0]
    if n % 2:
        raise ValueError(f"an odd row count ({n}) has no halves")
    order = torch.arange(n, device=qweight.device).view(2, n // 2).T.reshape(n)
    return qweight[order].contiguous(), scales[order].contiguous()
