"""Which dense weights a packed CPU model drops, and whether a model's
weights are all dense 16-bit ones.

A decoder projection (:class:`~asyncstep.models.layers.linear.ColumnParallelLinear`,
:class:`~asyncstep.models.layers.linear.RowParallelLinear`) keeps its dense
weight beside its packed copy for the steps the copy does not take (more
than its ``max_tokens`` rows, activations of another dtype, a format whose
kernels do not run here). Where the copy takes every step
(:func:`served_by_packed`: ``max_tokens`` at least :data:`EVERY_STEP`, its
dtype the model's, its kernels running on this machine) the dense weight is
never read: :func:`drop_dense_weights` replaces it with an empty tensor of
its dtype (the parameter, its name and its loader stay). The embedding and
the LM head (tied to it in SmolLM2) keep theirs.

:func:`dense_16_bit` (no packed copy of any weight, no experts, a 16-bit
dtype) is what CUDA's default ``batch_invariant`` asks of a model.

A dropped weight is empty; a step that would still read it fails loudly in
the matmul (a shape error) rather than silently. The packed-weights cache
(:mod:`asyncstep.models.weight_cache`) stores no dropped weight and drops
them again on load. May import torch, the linear and mixture-of-experts
layers and ``asyncstep.ops.packed``.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncstep.models.layers.moe import FusedMoE
from asyncstep.ops.packed import PackedWeight

__all__ = ["EVERY_STEP", "dense_16_bit", "drop_dense_weights", "dropped", "served_by_packed"]

#: ``packed_max_tokens`` of packed weights that serve every step.
EVERY_STEP = 1 << 30


def served_by_packed(module: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``module`` is a decoder projection whose packed copy takes
    every step of a ``dtype`` model on this machine."""
    if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
        return False
    packed = module.packed
    return (
        isinstance(packed, PackedWeight)
        and packed.max_tokens >= EVERY_STEP
        and packed.scales.dtype == dtype
        and packed.runs_here()
    )


def dropped(module: nn.Module) -> bool:
    """Whether ``module``'s dense weight was dropped."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.numel() == 0


def drop_dense_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Drop the dense weight of each of ``model``'s projections that
    :func:`served_by_packed`; the bytes freed."""
    freed = 0
    for module in model.modules():
        if served_by_packed(module, dtype) and not dropped(module):
            weight = module.get_parameter("weight")
            freed += weight.numel() * weight.element_size()
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return freed


def dense_16_bit(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``model`` (of ``dtype``) multiplies by dense 16-bit weights
    alone: a 16-bit dtype, no layer keeping a packed copy (Q4 / Q8, the LM
    head's too) and no mixture of experts."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    return not any(
        isinstance(module, FusedMoE) or getattr(module, "packed", None) is not None
        for module in model.modules()
    )
