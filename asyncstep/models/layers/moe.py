"""Mixture-of-experts layers: the router (:func:`select_experts`), the experts
(:class:`FusedMoE`) and a sparse MoE block of both (:class:`SparseMoeBlock`).

Tensor parallelism is vLLM's for experts without expert parallelism: every
rank holds every expert, each expert's intermediate dimension split by
``tp_size`` (``w13`` ``[E, 2 * I / tp, H]``: this rank's gate rows, then its up
rows; ``w2`` ``[E, H, I / tp]``), so each rank's result is a partial sum,
all-reduced like :class:`~asyncstep.models.layers.linear.RowParallelLinear`'s
(reduce-scattered along tokens under sequence parallelism, where the block
all-gathers its input rows first). The router's gate is replicated: every
rank routes every token alike. Expert parallelism is not implemented.

gpt-oss's experts (:mod:`asyncstep.models.gpt_oss`) carry biases
(``w13_bias`` ``[E, 2 * I / tp]``, this rank's gate then up columns;
``w2_bias`` ``[E, H]`` whole on every rank and added by TP rank 0 alone, so
the reduced sum holds it once), take the "swigluoai" activation and load
from one checkpoint tensor per projection (every expert's, gate and up
interleaved: :meth:`FusedMoE.weight_loader`'s string shards); their router
is biased and softmaxes its top-k logits (``scoring_func`` "topk_softmax").

The experts' matmuls are the model's op set's
(:meth:`~asyncstep.ops.base.OpSet.fused_experts`); their weights stay dense
(the CPU packing and the GPU 4-bit packing take the parallel linear layers
only).

Load balance: each :class:`FusedMoE` counts the token rows routed to each of
its experts (``tokens_per_expert``, on the device, no host sync: a CUDA
graph replays the count too), every row it computes: a step's padding rows
(CUDA graph sizes, sequence parallelism) count as well.

May import torch, :mod:`asyncstep.channels`, :mod:`asyncstep.ops` and the
other layers.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncstep.channels import get_tp_group
from asyncstep.errors import ModelLoadError
from asyncstep.models.layers.linear import (
    ReplicatedLinear,
    _make_param,
    divide,
    gather_tokens,
    reduce_partial_sums,
)
from asyncstep.ops.slot import OpSetSlot

__all__ = ["EXPERT_SHARDS", "STACKED_SHARDS", "FusedMoE", "SparseMoeBlock", "select_experts"]

#: vLLM's names of an expert's projections: gate (w1), down (w2), up (w3).
EXPERT_SHARDS = ("w1", "w2", "w3")
#: Every expert's projection in one checkpoint tensor (gpt-oss):
#: :meth:`FusedMoE._load_stacked`'s kinds.
STACKED_SHARDS = ("w13_interleaved", "w13_bias_interleaved", "w2", "w2_bias")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts: ``(topk_weights [T, k] float32, topk_ids [T, k]
    int32)``, the top ``k`` of the float32 softmax (or sigmoid) of
    ``router_logits`` ``[T, E]``, renormalised to sum to 1 where
    ``renormalize`` (torch's ``topk``: ties go to the lower expert id, as
    in transformers). "topk_softmax" (gpt-oss): the top ``k`` logits, then
    the softmax of those ``k``."""
    logits = router_logits.float()
    if scoring_func == "topk_softmax":
        top_logits, topk_ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), topk_ids.to(torch.int32)
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unsupported router scoring {scoring_func!r}")
    topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


class FusedMoE(nn.Module):
    """Every expert's gate/up and down projections, this rank's slice of
    each (see the module doc). ``forward`` takes the router's choice and
    returns the experts' weighted sum, reduced over the TP group where
    ``reduce_results``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        reduce_results: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
        bias: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.activation = activation
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = divide(
            intermediate_size, self.tp_size, "expert intermediate size"
        )
        inter = self.intermediate_size_per_partition
        self.reduce_results = reduce_results
        self.sequence_parallel = sequence_parallel
        self.w13_weight = _make_param(
            (num_experts, 2 * inter, hidden_size), params_dtype, self.weight_loader
        )
        self.w2_weight = _make_param(
            (num_experts, hidden_size, inter), params_dtype, self.weight_loader
        )
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w13_bias = _make_param((num_experts, 2 * inter), params_dtype, self.weight_loader)
            self.w2_bias = _make_param((num_experts, hidden_size), params_dtype, self.weight_loader)
        #: The model's op set.
        self.ops = ops or OpSetSlot()
        #: Token rows routed to each expert since the count was last reset.
        self.tokens_per_expert: torch.Tensor
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str] | str
    ) -> None:
        """One expert's checkpoint projection (``shard``: its expert id and
        ``w1`` gate, ``w3`` up or ``w2`` down), narrowed to this rank's slice;
        or (``shard`` a string, :data:`STACKED_SHARDS`) every expert's."""
        if isinstance(shard, str):
            self._load_stacked(param, loaded, shard)
            return
        expert, kind = shard
        if not 0 <= expert < self.num_experts or kind not in EXPERT_SHARDS:
            raise ModelLoadError(f"expert weight {shard} has no place in the model")
        inter = self.intermediate_size_per_partition
        if kind == "w2":
            target = param.data[expert]
            part = loaded.narrow(-1, self.tp_rank * inter, inter)
        else:
            target = param.data[expert].narrow(0, 0 if kind == "w1" else inter, inter)
            part = loaded.narrow(0, self.tp_rank * inter, inter)
        if target.shape != part.shape:
            raise ModelLoadError(
                f"expert {expert} {kind}: checkpoint shape {tuple(loaded.shape)} does not "
                f"match the model's {tuple(target.shape)} (per rank)"
            )
        target.copy_(part)

    def _load_stacked(self, param: nn.Parameter, loaded: torch.Tensor, kind: str) -> None:
        """Every expert's projection in one tensor (gpt-oss, transformers'
        layout): "w13_interleaved" ``[E, H, 2I]`` (``x @ w``, gate and up
        columns interleaved), "w13_bias_interleaved" ``[E, 2I]``, "w2"
        ``[E, I, H]``, "w2_bias" ``[E, H]`` (whole on every rank)."""
        e, h = self.num_experts, self.hidden_size
        inter = self.intermediate_size_per_partition
        full = inter * self.tp_size
        expected = {
            "w13_interleaved": (e, h, 2 * full),
            "w13_bias_interleaved": (e, 2 * full),
            "w2": (e, full, h),
            "w2_bias": (e, h),
        }.get(kind)
        if expected is None:
            raise ModelLoadError(f"stacked expert weight {kind!r} has no place in the model")
        if tuple(loaded.shape) != expected:
            raise ModelLoadError(
                f"experts {kind}: checkpoint shape {tuple(loaded.shape)} does not match the "
                f"model's {expected}"
            )
        start = self.tp_rank * inter
        if kind == "w2":
            part = loaded.transpose(1, 2).narrow(2, start, inter)
        elif kind == "w2_bias":
            part = loaded
        else:
            rows = loaded.transpose(1, 2) if kind == "w13_interleaved" else loaded
            gate, up = rows[:, 0::2].narrow(1, start, inter), rows[:, 1::2].narrow(1, start, inter)
            part = torch.cat((gate, up), dim=1)
        param.data.copy_(part)

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        ids = topk_ids.reshape(-1).long()
        self.tokens_per_expert.index_add_(0, ids, torch.ones_like(ids))
        w2_bias = self.w2_bias if self.tp_rank == 0 else None  # the reduced sum holds it once
        out = self.ops.ops.fused_experts(
            hidden,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.activation,
            self.w13_bias,
            w2_bias,
        )
        if self.reduce_results:
            out = reduce_partial_sums(out, self.sequence_parallel)
        return out


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE feed-forward: the replicated router ``gate``
    picks each token's ``top_k`` experts, ``experts`` computes them. Under
    sequence parallelism ``x`` and the result are this rank's token rows."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        scoring_func: str = "softmax",
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
        bias: bool = False,
        activation: str = "silu",
    ) -> None:
        """``bias``: the router and the experts carry biases (gpt-oss)."""
        super().__init__()
        self.ops = ops or OpSetSlot()
        self.top_k, self.renormalize, self.scoring_func = top_k, renormalize, scoring_func
        self.sequence_parallel = sequence_parallel
        self.gate = ReplicatedLinear(
            hidden_size, num_experts, bias=bias, params_dtype=params_dtype, ops=self.ops
        )
        self.experts = FusedMoE(
            num_experts,
            hidden_size,
            intermediate_size,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            ops=self.ops,
            bias=bias,
            activation=activation,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_tokens(x, self.sequence_parallel)
        topk_weights, topk_ids = select_experts(
            self.gate(x), self.top_k, renormalize=self.renormalize, scoring_func=self.scoring_func
        )
        return self.experts(x, topk_weights, topk_ids)
