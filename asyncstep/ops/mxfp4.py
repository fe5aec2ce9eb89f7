"""An MXFP4 projection in the CPU experts' layout (``cpu_moe.c``):
:class:`Mxfp4Weight` holds ``[E, rows, K]`` values as ``codes`` uint8 ``[E,
rows, K / 2]`` and ``scales`` uint8 ``[E, rows, K / 32]`` (E8M0: ``2 ** (s -
127)``). Byte ``j`` of a block's 16 holds value ``j`` in its low nibble and
value ``j + 16`` in its high one (GGUF's order: a vector of consecutive
values is one load and one shift, no interleaving shuffle); the codes are
FP4 E2M1 (``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives).

The HF checkpoint's blocks (``[..., rows, K / 32, 16]``, byte ``b`` holding
values ``2b`` and ``2b + 1``) are repacked once at load
(:meth:`Mxfp4Weight.from_checkpoint`; a GGUF's type-39 stacks reach the
model as such blocks too,
:func:`~asyncstep.models.loader.gguf_layouts.mxfp4_hf_parts`). Scales and
codes stay apart, so a row's codes are 16-byte blocks back to back. 4.25
bits a value.

:meth:`Mxfp4Weight.dequantize` gives the float32 values as
:func:`~asyncstep.models.mxfp4.dequantize_mxfp4` does (``ldexp`` of the
code's value), the numbers the kernel's packed path multiplies with.

Imports torch only.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["FP4_TABLE", "Mxfp4Weight"]

#: FP4 E2M1 code -> value (sign bit 8).
FP4_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Values sharing one scale.
BLOCK = 32


@dataclasses.dataclass(frozen=True)
class Mxfp4Weight:
    """``[E, rows, K]`` MXFP4 values in the kernel's layout (the module doc)."""

    codes: torch.Tensor  # uint8 [E, rows, K / 2]
    scales: torch.Tensor  # uint8 [E, rows, K / 32]

    def __post_init__(self) -> None:
        c, s = self.codes, self.scales
        if c.dtype != torch.uint8 or s.dtype != torch.uint8 or c.dim() != 3:
            raise ValueError(
                f"mxfp4 weight: uint8 [E, rows, K / 2] codes, got {c.dtype} {c.dim()}-D"
            )
        if s.shape != (*c.shape[:2], c.shape[2] // 16) or c.shape[2] % 16:
            raise ValueError(
                f"mxfp4 weight: codes {tuple(c.shape)} and scales {tuple(s.shape)} do not match"
            )
        if not (c.is_contiguous() and s.is_contiguous()):
            raise ValueError("mxfp4 weight: codes and scales must be contiguous")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, rows, K)`` of the values."""
        e, rows, half = self.codes.shape
        return e, rows, half * 2

    @property
    def nbytes(self) -> int:
        """Bytes held: codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    @classmethod
    def from_checkpoint(cls, blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Weight:
        """HF's ``blocks`` uint8 ``[E, rows, K / 32, 16]`` (byte ``b``: values
        ``2b`` low, ``2b + 1`` high) and ``scales`` ``[E, rows, K / 32]``
        repacked; ValueError for other shapes or dtypes."""
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(
                f"mxfp4: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
            )
        if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            raise ValueError(
                f"mxfp4: blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + (16,)"
            )
        values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32]
        packed = values[..., :16] | (values[..., 16:] << 4)
        e, rows, groups = scales.shape
        return cls(packed.reshape(e, rows, groups * 16).contiguous(), scales.contiguous())

    def narrow(self, dim: int, start: int, length: int) -> Mxfp4Weight:
        """Rows (``dim`` 1) or whole blocks of columns (``dim`` 2: ``start``
        and ``length`` multiples of 32) of every expert, copied."""
        if dim == 1:
            return Mxfp4Weight(
                self.codes.narrow(1, start, length).contiguous(),
                self.scales.narrow(1, start, length).contiguous(),
            )
        if dim != 2 or start % BLOCK or length % BLOCK:
            raise ValueError(f"mxfp4: columns {start}+{length} are not whole blocks of 32")
        return Mxfp4Weight(
            self.codes.narrow(2, start // 2, length // 2).contiguous(),
            self.scales.narrow(2, start // BLOCK, length // BLOCK).contiguous(),
        )

    def rows(self, index: torch.Tensor) -> Mxfp4Weight:
        """The rows ``index`` of every expert, in that order, copied."""
        return Mxfp4Weight(
            self.codes.index_select(1, index).contiguous(),
            self.scales.index_select(1, index).contiguous(),
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 values ``[E, rows, K]`` (``ldexp`` of each code's value)."""
        e, rows, k = self.shape
        table = torch.tensor(FP4_TABLE, dtype=torch.float32)
        blocks = self.codes.reshape(e, rows, k // BLOCK, 16)
        codes = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 32]
        exponents = (self.scales.to(torch.int32) - 127).unsqueeze(-1).float()
        return torch.ldexp(table[codes], exponents).reshape(e, rows, k)
