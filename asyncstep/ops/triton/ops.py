"""The Triton op set: the residual add + RMSNorm, ``silu(gate) * up`` and
the rotary embedding each in one kernel
(:mod:`asyncstep.ops.triton.fused`: float32 math, within the rounding of the
activations' dtype of the reference's). A step's rotation is its positions
alone: the kernels read cos and sin from the cache. RMSNorm without a
residual, and an add + norm starting the stream, are the reference's.
"""

from __future__ import annotations

import torch

from asyncstep.ops.base import RotaryCosSin
from asyncstep.ops.torch_ref import TorchOps

__all__ = ["TritonOps"]


class TritonOps(TorchOps):
    """The fused Triton kernels, with the reference's ops where they do not apply."""

    name = "triton"

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
        from asyncstep.ops.triton.fused import rotary_embedding

        return rotary_embedding(cos_sin.positions, q, k, cos_sin_cache, head_dim)
