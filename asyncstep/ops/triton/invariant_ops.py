"""The batch-invariant Triton op set (issue 40, vLLM's ``batch_invariant``):
a request's rows get the same bits whatever else is in its step.

:class:`TritonInvariantOps` ("triton-invariant") is the Triton op set with
every reduction made per row in an order fixed by the model's shape alone:
the linear layers and the LM head (float32 logits) through
:func:`~asyncstep.ops.triton.invariant_matmul.invariant_matmul` (one tile
configuration for every M, K split by the weight's shape alone: a decode
step runs a program per tile and split), RMSNorm one program per row (the
residual add + RMSNorm is :func:`~asyncstep.ops.triton.fused.fused_add_rms_norm`,
one program per row already; the norm without a residual is
:func:`~asyncstep.ops.triton.invariant_norm.rms_norm`), ``silu * up`` and
the rotary elementwise (the Triton op set's), the mixture of experts'
router (the Triton op set's: a program a token) and ``fused_experts`` (the
Triton op set's grouped GEMM for every T: ``gemv_max_pairs`` 0, never the
small-T path, whose sums run in another order; one tile for every T, no
split-K, a token's k expert rows summed in a fixed order), and the attention
:class:`~asyncstep.ops.triton.invariant_attention.TritonInvariantAttention`
(fixed key splits). Decode, verify and prompt rows go through the same
kernels: no one-row GEMV, no fused decode path, no whole-stack step path.
Packed copies of the weights (Q4 / Q8) are not used: they apply to steps
of at most so many rows, a choice by the step's size; the dense weights
always are. Every launch is sized from shapes: CUDA graphs (FULL and
PIECEWISE) capture it.

May import torch, triton (on use) and :mod:`asyncstep.ops`' base, packed
formats, reference op set and Triton op set and kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncstep.ops.base import AttentionOp, StepPath
from asyncstep.ops.packed import PackedWeight
from asyncstep.ops.torch_ref import per_head_rms_norms
from asyncstep.ops.triton.ops import TritonOps

__all__ = ["TritonInvariantOps"]


class TritonInvariantOps(TritonOps):
    """The Triton op set with batch-invariant matmuls, norms and attention."""

    name = "triton-invariant"

    def __init__(self, attention: AttentionOp | None = None) -> None:
        if attention is None:
            from asyncstep.ops.triton.invariant_attention import TritonInvariantAttention

            attention = TritonInvariantAttention()
        super().__init__(attention, fused_decode=False)
        self.gemv_max_pairs = 0  # every T through the grouped GEMM: one path, the same bits

    def step_path(self, layers: list[Any]) -> StepPath | None:
        return None

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: PackedWeight | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from asyncstep.ops.triton.invariant_matmul import invariant_matmul

        y = invariant_matmul(x, weight)
        return y if bias is None else y + bias

    def logits(
        self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None
    ) -> torch.Tensor:
        from asyncstep.ops.triton.invariant_matmul import invariant_matmul

        return invariant_matmul(x, weight, torch.float32)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, float32_residual: bool
    ) -> torch.Tensor:
        from asyncstep.ops.triton.invariant_norm import rms_norm

        return rms_norm(x, weight, eps)

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
        """Two norms, each through this op set's :meth:`rms_norm` (one program a row)."""
        return per_head_rms_norms(self.rms_norm, q, k, q_weight, k_weight, eps, float32_residual)

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
            from asyncstep.ops.triton.invariant_norm import rms_norm

            stream = x.float() if float32_residual else x
            return rms_norm(stream, weight, eps).to(x.dtype), stream
        return super().add_rms_norm(
            x,
            residual,
            weight,
            eps,
            float32_residual=float32_residual,
            own_residual=own_residual,
        )
