"""The fused decode: a decoder layer's step of a few tokens (a batch-1
decode) as four GEMVs over its packed 4-bit weights, the elementwise
kernels folded into them (issue 28):

- ``qkv_proj``: the input RMSNorm in its prologue (each program sums the
  squares of the row it streams x from, and scales its dot products);
- ``o_proj``: the residual add in its epilogue (it returns the new residual
  stream);
- ``gate_up_proj``: the post-attention RMSNorm in its prologue;
- ``down_proj``: SiLU·mul in its prologue, the residual add in its epilogue.

So a layer is qkv, the rotary + KV store, the attention (two kernels) and
three GEMVs, against ten kernels unfused. The layers pass the residual
stream (``hidden + residual`` of the unfused layer) alone. The result
equals the unfused layer's but for the rounding of the normed rows (kept
in float32 here, rounded to the activations' dtype there); the residual
adds and SiLU·mul round as the unfused kernels do.

It applies where every linear layer of the layer holds a
:class:`~asyncstep.models.layers.gpu_quant.GpuQ4Weight` for the step's
size, without bias, with one tensor-parallel rank (the row-parallel layers'
epilogue would add the residual to a partial sum).

Kernels: :func:`asyncstep.gpu.triton_quant.q4_gemv`'s prologues and epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncstep.models.layers.gpu_quant import GpuQ4Weight, GpuQ8Weight
from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear


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
