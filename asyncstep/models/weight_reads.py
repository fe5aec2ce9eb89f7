"""The bytes of weights a forward step of a loaded model reads
(:class:`~asyncstep.datatypes.WeightReads`): what a memory-bound step
cannot go below.

Layer by layer: a linear layer (and the LM head) with a packed copy
(:class:`~asyncstep.ops.packed.PackedWeight`: the CPU's Q4/Q8
blocks or torch's int4/int8, the GPU's Q4) reads that copy's bytes in a
step of at most its ``max_tokens`` tokens and its dense weight in a larger
one; one without reads its dense weight; the input embedding reads one row
per token of the step, not its table (a tied LM head reads the table whole,
as a projection); a MoE layer's experts (weights and biases) are an
:class:`~asyncstep.datatypes.ExpertReads` of their routing, read by the
experts a step's tokens pick; every other parameter (norms, biases, the
router) is read whole.
Buffers (the rotary tables) are left out. Imports torch and the model's
layers only.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from asyncstep.datatypes import ExpertReads, PackedReads, WeightReads
from asyncstep.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncstep.models.layers.moe import FusedMoE
from asyncstep.ops.packed import PackedWeight

__all__ = ["weight_reads"]


def weight_reads(model: nn.Module) -> WeightReads:
    """The weight bytes ``model``'s forward steps read (see the module doc)."""
    dense = 0
    row = 0
    tiers: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    routes: dict[tuple[int, int], int] = defaultdict(int)
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if isinstance(module, FusedMoE):
            routes[module.num_experts, module.top_k] += sum(_nbytes(p) for p in own.values())
            continue
        weight = own.pop("weight", None)
        dense += sum(_nbytes(p) for p in own.values())  # biases
        if weight is None:
            continue
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | ParallelLMHead):
            packed = getattr(module, "packed", None)
            if isinstance(packed, PackedWeight):
                tier = tiers[packed.max_tokens]
                tier[0] += packed.nbytes
                tier[1] += _nbytes(weight)
            else:
                dense += _nbytes(weight)
        elif isinstance(module, VocabParallelEmbedding):
            row = max(row, weight.shape[-1] * weight.element_size())
        else:
            dense += _nbytes(weight)
    packed_reads = [PackedReads(k, *tiers[k]) for k in sorted(tiers)]
    experts = [ExpertReads(e, k, b) for (e, k), b in sorted(routes.items())]
    return WeightReads(
        dense_bytes=dense, packed=packed_reads, embedding_row_bytes=row, experts=experts
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
