"""Mixture-of-experts layers: the router (:func:`select_experts`), the experts
(:class:`FusedMoE`) and a sparse MoE block of both (:class:`SparseMoeBlock`).

Tensor parallelism is vLLM's for experts without expert parallelism: every
rank holds every expert, each expert's intermediate dimension split by
``tp_size`` (``w13`` ``[E, 2 * I / tp, H]``: this rank's gate rows, then its up
rows; ``w2`` ``[E, H, I / tp]``), so each rank's result is a partial sum,
all-reduced like :class:`~asyncstep.models.layers.linear.RowParallelLinear`'s
(reduce-scattered along tokens under sequence parallelism, where the block
all-gathers its input rows first). The router's gate is replicated: every
rank routes every token alike.

Expert parallelism (the EP group of :func:`~asyncstep.channels.get_ep_group`
larger than one: the TP group): each rank holds ``E / ep`` whole experts
(``w13`` ``[E / ep, 2 * I, H]``, ``w2`` ``[E / ep, H, I]``; rank ``r`` the
experts ``[r * E / ep, (r + 1) * E / ep)``; the checkpoint's other experts
are skipped as they load), routes its share of the token rows (a slice of
the replicated rows, or its own rows under sequence parallelism), and
exchanges the rows with the experts' ranks by all-to-all
(:mod:`asyncstep.models.layers.expert_parallel`); the results are all-gathered
back to every rank (no all-reduce), or stay this rank's rows under sequence
parallelism.

The experts' matmuls are the model's op set's
(:meth:`~asyncstep.ops.base.OpSet.fused_experts`); their weights stay dense
(the CPU packing and the GPU 4-bit packing take the parallel linear layers
only).

Load balance: each :class:`FusedMoE` counts the token rows routed to each of
its experts (``tokens_per_expert``, on the device, no host sync: a CUDA
graph replays the count too), every row it computes: a step's padding rows
(CUDA graph sizes, sequence parallelism) count as well. Under expert
parallelism every rank counts the whole group's rows for every expert (the
counts come with the dispatch plan), as every TP rank does without it.

May import torch, :mod:`asyncstep.channels`, :mod:`asyncstep.ops` and the
other layers.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncstep.channels import get_ep_group, get_tp_group
from asyncstep.errors import ModelLoadError
from asyncstep.models.layers import expert_parallel
from asyncstep.models.layers.linear import (
    ReplicatedLinear,
    _make_param,
    divide,
    gather_tokens,
    reduce_partial_sums,
)
from asyncstep.ops.slot import OpSetSlot

__all__ = ["EXPERT_SHARDS", "FusedMoE", "SparseMoeBlock", "select_experts"]

#: vLLM's names of an expert's projections: gate (w1), down (w2), up (w3).
EXPERT_SHARDS = ("w1", "w2", "w3")


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
    in transformers)."""
    logits = router_logits.float()
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
    """This rank's experts' gate/up and down projections: every expert's
    slice, or under expert parallelism its experts whole (see the module
    doc). ``forward`` takes the router's choice and returns the experts'
    weighted sum, reduced over the TP group where ``reduce_results``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        top_k: int = 1,
        reduce_results: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ) -> None:
        super().__init__()
        tp, ep = get_tp_group(), get_ep_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.ep_rank, self.ep_size = ep.rank_in_group, ep.world_size
        self.use_ep = self.ep_size > 1
        self.num_experts = num_experts
        self.top_k = top_k
        #: This rank's experts: ``[expert_start, expert_start + num_local_experts)``.
        self.num_local_experts = divide(num_experts, self.ep_size, "expert count")
        self.expert_start = self.ep_rank * self.num_local_experts
        self.hidden_size = hidden_size
        # Under EP each expert is whole; else split over the TP ranks.
        split = 1 if self.use_ep else self.tp_size
        self.intermediate_size_per_partition = divide(
            intermediate_size, split, "expert intermediate size"
        )
        inter = self.intermediate_size_per_partition
        self.reduce_results = reduce_results
        self.sequence_parallel = sequence_parallel
        local = self.num_local_experts
        self.w13_weight = _make_param(
            (local, 2 * inter, hidden_size), params_dtype, self.weight_loader
        )
        self.w2_weight = _make_param((local, hidden_size, inter), params_dtype, self.weight_loader)
        #: The model's op set.
        self.ops = ops or OpSetSlot()
        #: Token rows routed to each expert since the count was last reset.
        self.tokens_per_expert: torch.Tensor
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str]
    ) -> None:
        """One expert's checkpoint projection (``shard``: its expert id and
        ``w1`` gate, ``w3`` up or ``w2`` down), narrowed to this rank's slice
        (under expert parallelism: whole, and skipped unless this rank holds
        the expert)."""
        expert, kind = shard
        if not 0 <= expert < self.num_experts or kind not in EXPERT_SHARDS:
            raise ModelLoadError(f"expert weight {shard} has no place in the model")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return  # another EP rank's expert
        inter = self.intermediate_size_per_partition
        rank = 0 if self.use_ep else self.tp_rank
        if kind == "w2":
            target = param.data[local]
            part = loaded.narrow(-1, rank * inter, inter)
        else:
            target = param.data[local].narrow(0, 0 if kind == "w1" else inter, inter)
            part = loaded.narrow(0, rank * inter, inter)
        if target.shape != part.shape:
            raise ModelLoadError(
                f"expert {expert} {kind}: checkpoint shape {tuple(loaded.shape)} does not "
                f"match the model's {tuple(target.shape)} (per rank)"
            )
        target.copy_(part)

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each row's experts. Under expert parallelism
        ``hidden`` holds this rank's share of the rows (see the module doc)
        and so does the result (no reduction)."""
        if self.use_ep:
            return self.forward_ep(hidden, topk_weights, topk_ids)
        ids = topk_ids.reshape(-1).long()
        self.tokens_per_expert.index_add_(0, ids, torch.ones_like(ids))
        out = self.ops.ops.fused_experts(
            hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids
        )
        if self.reduce_results:
            out = reduce_partial_sums(out, self.sequence_parallel)
        return out

    def forward_ep(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch this rank's pairs to the experts' ranks, compute the pairs
        sent here on the local experts, combine the results back."""
        ep = get_ep_group()
        plan = expert_parallel.plan_dispatch(topk_ids, self.num_experts, ep)
        self.tokens_per_expert += plan.tokens_per_expert
        rows = expert_parallel.dispatch(hidden, topk_ids.shape[1], plan, ep)
        expert_out = self.ops.ops.fused_experts(
            rows,
            self.w13_weight,
            self.w2_weight,
            torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device),
            plan.recv_expert_ids.to(torch.int32).unsqueeze(1),
        )
        return expert_parallel.combine(expert_out, topk_weights, plan, ep)


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
    ) -> None:
        super().__init__()
        self.ops = ops or OpSetSlot()
        self.top_k, self.renormalize, self.scoring_func = top_k, renormalize, scoring_func
        self.sequence_parallel = sequence_parallel
        self.gate = ReplicatedLinear(
            hidden_size, num_experts, params_dtype=params_dtype, ops=self.ops
        )
        self.experts = FusedMoE(
            num_experts,
            hidden_size,
            intermediate_size,
            top_k=top_k,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            ops=self.ops,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.use_ep:
            return self.forward_ep(x)
        x = gather_tokens(x, self.sequence_parallel)
        return self.experts(x, *self.route(x))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``(topk_weights, topk_ids)`` (:func:`select_experts`)."""
        return select_experts(
            self.gate(x), self.top_k, renormalize=self.renormalize, scoring_func=self.scoring_func
        )

    def forward_ep(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: route and compute this rank's rows (its own
        under sequence parallelism, else its slice of the replicated rows,
        all-gathered after)."""
        if self.sequence_parallel:
            return self.experts(x, *self.route(x))
        ep = get_ep_group()
        start, end, chunk = expert_parallel.local_rows(x.shape[0], ep)
        mine = x[start:end]
        out = self.experts(mine, *self.route(mine))
        return expert_parallel.gather_rows(out, x.shape[0], chunk, ep)
