"""The Triton op set: the residual add + RMSNorm, ``silu(gate) * up`` and
the rotary embedding each in one kernel
(:mod:`asyncstep.ops.triton.fused`: float32 math, within the rounding of the
activations' dtype of the reference's). A step's rotation is its positions
alone: the kernels read cos and sin from the cache. RMSNorm without a
residual, and an add + norm starting the stream, are the reference's. With
``fused_decode``: a one-row step of 16-bit dense weights on CUDA multiplies
with :func:`~asyncstep.ops.triton.gemv.dense_gemv`, and the step path is
the fused decode over Q4 layers (:mod:`~asyncstep.ops.triton.fused_decode`).
With ``int8_activations`` (the config's ``gpu_q4_activations="int8"``),
the GPU's Q4 / Q8 GEMVs, fused or not, quantize a 16-bit x per block of 32
to int8 (:mod:`~asyncstep.ops.triton.quant_packed`); else they multiply x's
own values in float32.

May import torch, triton (on use) and :mod:`asyncstep.ops`' base,
reference and Triton kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from asyncstep.ops.base import AttentionOp, RotaryCosSin, StepPath
from asyncstep.ops.packed import PackedWeight
from asyncstep.ops.torch_ref import TorchOps
from asyncstep.ops.triton.quant_weight import GpuQ4Weight

__all__ = ["TritonOps"]


class TritonOps(TorchOps):
    """The fused Triton kernels, with the reference's ops where they do not apply."""

    name = "triton"

    def __init__(
        self, attention: AttentionOp, *, fused_decode: bool = False, int8_activations: bool = False
    ) -> None:
        super().__init__(attention)
        self.fused_decode = fused_decode
        self.int8_activations = int8_activations
        from asyncstep.ops.triton.fused_moe import GEMV_MAX_PAIRS

        #: The most pairs (``T * top_k``) whose experts take the small-T
        #: path (:data:`~asyncstep.ops.triton.fused_moe.GEMV_MAX_PAIRS`; 0: never).
        self.gemv_max_pairs = GEMV_MAX_PAIRS

    def step_path(self, layers: list[Any]) -> StepPath | None:
        if not self.fused_decode:
            return None
        from asyncstep.ops.triton.fused_decode import FusedDecodePath

        return FusedDecodePath.build(layers, int8_x=self.int8_activations)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: PackedWeight | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(packed, GpuQ4Weight) and packed.applies(x):
            y = packed.mm(x, int8_x=self.int8_activations)
        elif packed is not None and packed.applies(x):
            y = packed.mm(x)
        elif self.fused_decode and _one_row_on_cuda(x, weight):
            from asyncstep.ops.triton.gemv import dense_gemv

            return dense_gemv(x, weight, bias=bias)  # the bias in its epilogue
        else:
            return F.linear(x, weight, bias)
        return y if bias is None else y + bias

    def logits(
        self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None
    ) -> torch.Tensor:
        return self.linear(x, weight, packed)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        *,
        float32_residual: bool,
        own_residual: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return super().add_rms_norm(
                x, residual, weight, eps, float32_residual=float32_residual, own_residual=False
            )
        from asyncstep.ops.triton.fused import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps)

    def qk_rms_norm(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        *,
        float32_residual: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On CUDA both norms in one kernel
        (:func:`~asyncstep.ops.triton.fused.qk_rms_norm`); elsewhere, or
        with ``float32_residual``, the reference's two."""
        if not q.is_cuda or float32_residual:
            return super().qk_rms_norm(
                q, k, q_weight, k_weight, eps, float32_residual=float32_residual
            )
        from asyncstep.ops.triton.fused import qk_rms_norm

        return qk_rms_norm(q, k, q_weight, k_weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from asyncstep.ops.triton.fused import silu_and_mul

        return silu_and_mul(gate_up)

    def rotary_cos_sin(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RotaryCosSin:
        return RotaryCosSin(positions)

    def rotary(
        self,
        cos_sin: RotaryCosSin,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from asyncstep.ops.triton.rotary import rotary_embedding

        return rotary_embedding(cos_sin.positions, q, k, cos_sin_cache, head_dim)

    def fused_experts(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mixture of experts' weighted sum ``[T, H]``:
        :func:`~asyncstep.ops.triton.fused_moe.fused_experts` (w13 is gate
        rows then up rows for every activation), the small-T path at up to
        :attr:`gemv_max_pairs` pairs, the grouped GEMM past them."""
        from asyncstep.ops.triton.fused_moe import fused_experts

        return fused_experts(
            hidden,
            w13,
            w2,
            topk_weights,
            topk_ids,
            activation,
            w13_bias,
            w2_bias,
            gemv_max_pairs=self.gemv_max_pairs,
        )

    def select_experts(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        scoring_func: str = "softmax",
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One kernel, a program a token, the counts among its work
        (:func:`~asyncstep.ops.triton.moe_routing.topk_route`)."""
        from asyncstep.ops.triton.moe_routing import topk_route

        return topk_route(
            router_logits,
            top_k,
            renormalize=renormalize,
            scoring_func=scoring_func,
            counts=counts,
        )


def _one_row_on_cuda(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and x.dim() > 0
        and x.numel() == x.shape[-1]
    )
