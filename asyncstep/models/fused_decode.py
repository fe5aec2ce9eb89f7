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

Tried first and slower (``benchmarks/results/fused_decode``): both norms
and SiLU·mul in the prologues of the GEMV that reads them, each program
redoing the per-element work over the whole row.

It applies where every linear layer of the layer holds a
:class:`~asyncstep.models.layers.gpu_quant.GpuQ4Weight` for the step's
size, or where none is packed and the weights are 16-bit (a one-row step on
CUDA: :class:`DenseDecodeWeight`, gate_up's halves read as they are stored),
without bias, with one tensor-parallel rank (the row-parallel layers'
epilogue would add the residual to a partial sum).

Kernels: :func:`asyncstep.gpu.triton_quant.q4_gemv_fused`,
:func:`asyncstep.gpu.triton_gemv.dense_gemv_fused`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from asyncstep.models.layers.gpu_quant import GpuQ4Weight, GpuQ8Weight
from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:  # triton is imported on use
    from asyncstep.gpu.triton_quant import NormedRows


@dataclass(frozen=True)
class DenseDecodeWeight:
    """A layer's dense 16-bit weight, for the fused decode of one-row steps
    on CUDA (:func:`~asyncstep.gpu.triton_gemv.dense_gemv_fused`)."""

    weight: torch.Tensor
    #: Off CUDA (the Triton interpreter) only where a test asks for it.
    cuda_only: ClassVar[bool] = True

    @classmethod
    def of(cls, layer: ColumnParallelLinear | RowParallelLinear) -> DenseDecodeWeight | None:
        weight = layer.weight
        if layer.packed is not None or weight.dtype not in (torch.bfloat16, torch.float16):
            return None
        return cls(weight)

    def applies(self, x: torch.Tensor) -> bool:
        w = self.weight
        one_row = x.dim() > 0 and x.numel() == x.shape[-1]
        device_ok = x.device == w.device and (x.is_cuda or not self.cuda_only)
        return one_row and device_ok and x.dtype == w.dtype


DecodeWeight = GpuQ4Weight | DenseDecodeWeight


@dataclass(frozen=True)
class FusedDecodeWeights:
    """A decoder layer's four weights, as the fused decode takes them: all
    packed Q4, or all dense 16-bit."""

    qkv: DecodeWeight
    o: DecodeWeight
    gate_up: DecodeWeight
    down: DecodeWeight

    @classmethod
    def of(
        cls,
        qkv: ColumnParallelLinear,
        o: RowParallelLinear,
        gate_up: ColumnParallelLinear,
        down: RowParallelLinear,
    ) -> FusedDecodeWeights | None:
        """The layers' packed weights, or their dense 16-bit weights where
        none is packed; None where one of them has another packing (or an
        8-bit one), has a bias or is split over tensor-parallel ranks."""
        layers = (qkv, o, gate_up, down)
        if any(layer.tp_size != 1 or getattr(layer, "bias", None) is not None for layer in layers):
            return None
        dense = [DenseDecodeWeight.of(layer) for layer in layers]
        if all(weight is not None for weight in dense):
            return cls(*dense)  # type: ignore[arg-type]
        packed = []
        for layer in layers:
            weight = layer.packed
            if not isinstance(weight, GpuQ4Weight) or isinstance(weight, GpuQ8Weight):
                return None
            packed.append(weight)
        return cls(*packed)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether a step of rows ``x`` takes the packed weights (its size and device)."""
        return all(w.applies(x) for w in (self.qkv, self.o, self.gate_up, self.down))

    def prepare(self) -> None:
        """Store a packed gate_up's rows interleaved (once), as its SiLU·mul
        epilogue reads them (a dense one's epilogue reads the two halves)."""
        if isinstance(self.gate_up, GpuQ4Weight):
            self.gate_up.interleave_halves()


def fused_gemv(
    weight: DecodeWeight, x: torch.Tensor, **fused: Any
) -> tuple[torch.Tensor, NormedRows | None]:
    """:func:`~asyncstep.gpu.triton_quant.q4_gemv_fused` of a packed
    ``weight``, :func:`~asyncstep.gpu.triton_gemv.dense_gemv_fused` of a
    dense one (``silu_pairs``: its halves)."""
    if isinstance(weight, DenseDecodeWeight):
        from asyncstep.gpu.triton_gemv import dense_gemv_fused

        silu = fused.pop("silu_pairs", False)
        return dense_gemv_fused(x, weight.weight, silu_halves=silu, **fused)
    from asyncstep.gpu.triton_quant import q4_gemv_fused

    return q4_gemv_fused(x, weight.data, weight.scales, **fused)
