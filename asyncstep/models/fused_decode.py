"""The fused decode: a decoder layer's step of a few tokens (a batch-1
decode) as four GEMVs over its packed 4-bit weights, the elementwise
kernels folded into them (issue 28):

- ``o_proj``: the residual add in its epilogue (it returns the new
  residual stream), and the post-attention RMSNorm's per-element part: the
  stream times the norm's weight (float32) and the sums of its squares over
  each program's features;
- ``gate_up_proj``: that norm in its prologue (one scale a row, from the
  sums, on its dot products), SiLU·mul in its epilogue (its rows are
  stored gate and up interleaved, so that a program holds both of a pair);
- ``down_proj``: the residual add in its epilogue, and the next layer's
  input RMSNorm's part as o's;
- ``qkv_proj``: that norm in its prologue (the first layer's: its own
  sums, over the embedding's output).

So a layer is qkv, the rotary + KV store, the attention (two kernels) and
three GEMVs: seven kernels against ten unfused. The layers pass the
residual stream (``hidden + residual`` of the unfused layer) alone. The
result equals the unfused layer's but for the rounding of the normed rows
(kept in float32 here, rounded to the activations' dtype there); the
residual adds and SiLU·mul round as the unfused kernels do.

Tried first and slower (``benchmarks/studies/decode_kernels/README.md``): both norms
and SiLU·mul in the prologues of the GEMV that reads them, each program
redoing the per-element work over the whole row.

It applies where every linear layer of the layer holds a
:class:`~asyncstep.models.layers.gpu_quant.GpuQ4Weight` for the step's
size, without bias, with one tensor-parallel rank (the row-parallel layers'
epilogue would add the residual to a partial sum).

Kernels: :func:`asyncstep.ops.triton.quant.q4_gemv_fused`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncstep.models.layers.gpu_quant import GpuQ4Weight, GpuQ8Weight
from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:  # triton is imported on use
    from asyncstep.ops.triton.quant import NormedRows


@dataclass(frozen=True)
class FusedDecodeWeights:
    """A decoder layer's four packed weights, as the fused decode takes them."""

    qkv: GpuQ4Weight
    o: GpuQ4Weight
    gate_up: GpuQ4Weight
    down: GpuQ4Weight

    @classmethod
    def of(
        cls,
        qkv: ColumnParallelLinear,
        o: RowParallelLinear,
        gate_up: ColumnParallelLinear,
        down: RowParallelLinear,
    ) -> FusedDecodeWeights | None:
        """The layers' packed weights, or None where one of them has none
        (or an 8-bit one), has a bias or is split over tensor-parallel ranks."""
        packed = []
        for layer in (qkv, o, gate_up, down):
            weight = layer.packed
            if not isinstance(weight, GpuQ4Weight) or isinstance(weight, GpuQ8Weight):
                return None
            if layer.tp_size != 1 or getattr(layer, "bias", None) is not None:
                return None
            packed.append(weight)
        return cls(*packed)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether a step of rows ``x`` takes the packed weights (its size and device)."""
        return all(w.applies(x) for w in (self.qkv, self.o, self.gate_up, self.down))

    def prepare(self) -> None:
        """Store gate_up's rows interleaved (once), as its SiLU·mul epilogue reads them."""
        self.gate_up.interleave_halves()


def fused_gemv(
    weight: GpuQ4Weight, x: torch.Tensor, **fused: Any
) -> tuple[torch.Tensor, NormedRows | None]:
    """:func:`~asyncstep.ops.triton.quant.q4_gemv_fused` of ``weight``."""
    from asyncstep.ops.triton.quant import q4_gemv_fused

    return q4_gemv_fused(x, weight.data, weight.scales, **fused)
