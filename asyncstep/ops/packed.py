"""Weights packed for small steps on the CPU.

A step of a few tokens is bound by reading the weights, so a linear layer
may keep, beside its dense weight, a packed copy for torch's weight-only CPU
matmuls: int4 in groups of :data:`GROUP_SIZE` input features (a scale and a
zero per group: ``w = (q - 8) * scale + zero``) or int8 with a scale per
output row. :class:`PackedWeight` is that copy; the layer uses it for steps
of at most ``max_tokens`` rows and its dense weight above (the packed
kernels dequantize per call, which a large step pays on every row).

:func:`pack_int4` packs a weight only when that is lossless: when its
float32 values are exactly a 4-bit code times a group scale plus a group
offset, as a GGUF's Q4_0 or Q4_1 tensor dequantizes (llama.cpp's quantizers
put a code 0, and for Q4_1 a code 15, in every block, which pins the grid);
:func:`pack_int8_rows` packs an 8-bit weight (a Q8_0 tensor: a scale per 32
values) with one scale per row, which rounds each value to the row's grid.
The scales take the model's dtype, so a bfloat16 model rounds them as it
rounds its dense weights. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Input features per int4 group (GGUF's Q4_0/Q4_1/Q8_0 block).
GROUP_SIZE = 32
#: How far a value may sit from its 4-bit grid point and still count as on
#: it: a few float32 rounding steps of the group's largest magnitude.
_ON_GRID_RTOL = 8 * torch.finfo(torch.float32).eps


@dataclass
class PackedWeight:
    """A ``[out_features, in_features]`` weight packed for torch's CPU
    weight-only matmuls (see the module's docstring)."""

    kind: str  # "int4" or "int8"
    data: torch.Tensor  # int4: torch's packed layout; int8: [out, in] int8
    #: int4: ``[in / GROUP_SIZE, out, 2]`` (scale, zero); int8: ``[out]`` scales.
    scales: torch.Tensor
    out_features: int
    in_features: int
    #: Steps of at most this many rows use the packed weight.
    max_tokens: int

    def applies(self, x: torch.Tensor) -> bool:
        return x.shape[0] <= self.max_tokens and x.dtype == self.scales.dtype

    def runs_here(self) -> bool:
        """Whether this machine runs the format's matmul (torch's: always)."""
        return True

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, in_features]`` of the scales' dtype."""
        if self.kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, GROUP_SIZE, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """An LM head's ``x @ w.T``: :meth:`mm`'s, or float32 where a
        format's matmul sums in float32 (its rounding to ``x``'s dtype would
        tie tokens that float32 separates)."""
        return self.mm(x)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


def pack_int4(weight: torch.Tensor, dtype: torch.dtype, max_tokens: int) -> PackedWeight | None:
    """``weight`` (float32, ``[out, in]``) as int4 groups with scales in
    ``dtype``, or None when it is not exactly 4-bit (see the module's docstring)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.float32 or in_features % GROUP_SIZE or out_features % 2:
        return None
    groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    found = _int4_grid(groups)
    if found is None:
        return None
    codes, scale, zero = found
    data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.reshape(out_features, in_features).to(torch.int32), 1
    )
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return PackedWeight("int4", data, scales, out_features, in_features, max_tokens)


def _int4_grid(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes ``[out, groups, 32]`` in [0, 15] and, per group, the scale and
    zero with ``w = (q - 8) * scale + zero`` exactly (to float32 rounding),
    or None if a group is on neither grid: Q4_1's (offset = the group's
    minimum, scale = its range / 15) or Q4_0's (no offset, code 0 at the
    value of largest magnitude: scale = -that / 8)."""
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    tol = (_ON_GRID_RTOL * torch.maximum(lo.abs(), hi.abs()) + 1e-30).unsqueeze(-1)
    # Q4_1: w = lo + s * q.
    s1 = (hi - lo) / 15
    q1 = _codes(groups - lo.unsqueeze(-1), s1)
    fits1 = _on_grid(q1 * s1.unsqueeze(-1) + lo.unsqueeze(-1), groups, tol)
    if bool(fits1.all()):
        return q1.to(torch.uint8), s1, lo + 8 * s1
    # Q4_0: w = s * (q - 8), the largest magnitude at q = 0.
    s0 = -torch.where(lo.abs() >= hi.abs(), lo, hi) / 8
    q0 = _codes(groups, s0) + 8
    fits0 = _on_grid((q0 - 8) * s0.unsqueeze(-1), groups, tol)
    fits0 &= ((q0 >= 0) & (q0 <= 15)).all(dim=-1)
    if not bool((fits1 | fits0).all()):
        return None
    codes = torch.where(fits1.unsqueeze(-1), q1, q0).clamp(0, 15)
    scale = torch.where(fits1, s1, s0)
    zero = torch.where(fits1, lo + 8 * s1, torch.zeros_like(s0))
    return codes.to(torch.uint8), scale, zero


def _on_grid(rebuilt: torch.Tensor, groups: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """Per group: every value within ``tol`` of its rebuilt grid value."""
    return (rebuilt.sub_(groups).abs_() <= tol).all(dim=-1)


def _codes(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(values / scale)`` per group (0 where a group's scale is 0)."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
    return torch.round(values / safe)


def is_int8_blocks(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (float32) is exactly 8-bit per block of 32 (a
    GGUF Q8_0 tensor, dequantized: ``w = d * q``, |q| <= 127, the block's
    largest magnitude at ``|q| = 127``)."""
    if weight.dtype != torch.float32 or weight.shape[-1] % GROUP_SIZE:
        return False
    blocks = weight.reshape(-1, GROUP_SIZE)
    amax = blocks.abs().amax(dim=-1)
    d = amax / 127
    q = _codes(blocks, d)
    tol = _ON_GRID_RTOL * amax.unsqueeze(-1) + 1e-30
    return bool(((q * d.unsqueeze(-1) - blocks).abs() <= tol).all())


def pack_int8_rows(weight: torch.Tensor, dtype: torch.dtype, max_tokens: int) -> PackedWeight:
    """``weight`` (``[out, in]``) as int8 with one scale per row (in ``dtype``):
    each value rounded to its row's grid of 255 steps."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127
    codes = _codes(w, scale).clamp(-127, 127).to(torch.int8)
    out_features, in_features = w.shape
    return PackedWeight("int8", codes, scale.to(dtype), out_features, in_features, max_tokens)
