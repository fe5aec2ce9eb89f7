"""Mixture-of-experts layers: the router (the op set's ``select_experts``;
:func:`select_experts` the reference's, re-exported here), the experts
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

gpt-oss's experts (:mod:`asyncstep.models.gpt_oss`) carry biases
(``w13_bias`` ``[E, 2 * I / tp]``, this rank's gate then up columns;
``w2_bias`` ``[E, H]`` whole on every rank and added by TP rank 0 alone, so
the reduced sum holds it once), take the "swigluoai" activation and load
from one checkpoint tensor per projection (every expert's, gate and up
interleaved: :meth:`FusedMoE.weight_loader`'s string shards); their router
is biased and softmaxes its top-k logits (``scoring_func`` "topk_softmax").

The experts' matmuls are the model's op set's
(:meth:`~asyncstep.ops.base.OpSet.fused_experts`); their weights are dense,
but gpt-oss's MXFP4 experts the loader keeps packed (:meth:`FusedMoE.load_mxfp4`:
``w13_mxfp4`` / ``w2_mxfp4``, the dense parameters empty), which an op set
that ``takes_mxfp4_experts`` (the CPU's) computes on; for another, or once
the model is not float32, the first forward dequantizes them, once.

Load balance: each :class:`FusedMoE` counts the token rows routed to each of
its experts (``tokens_per_expert``, on the device, no host sync: a CUDA
graph replays the count too), every row it computes: a step's padding rows
(CUDA graph sizes, sequence parallelism) count as well; a
:class:`SparseMoeBlock`'s router counts them (``select_experts(counts=)``). Under expert
parallelism every rank counts the whole group's rows for every expert (the
counts come with the dispatch plan), as every TP rank does without it.

May import torch, :mod:`asyncstep.channels`, :mod:`asyncstep.ops` and the
other layers.
"""

from __future__ import annotations

import time

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
from asyncstep.ops.base import TakesMxfp4Experts
from asyncstep.ops.mxfp4 import Mxfp4Weight
from asyncstep.ops.slot import OpSetSlot
from asyncstep.ops.torch_moe import select_experts

__all__ = [
    "EXPERT_SHARDS",
    "STACKED_SHARDS",
    "ExpertParallelStage",
    "FusedMoE",
    "SparseMoeBlock",
    "SparseMoeStage",
    "select_experts",
]

#: vLLM's names of an expert's projections: gate (w1), down (w2), up (w3).
EXPERT_SHARDS = ("w1", "w2", "w3")
#: Every expert's projection in one checkpoint tensor (gpt-oss):
#: :meth:`FusedMoE._load_stacked`'s kinds.
STACKED_SHARDS = ("w13_interleaved", "w13_bias_interleaved", "w2", "w2_bias")


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
        bias: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.activation = activation
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
        #: The projections kept MXFP4 (:meth:`load_mxfp4`; None: dense).
        self.w13_mxfp4: Mxfp4Weight | None = None
        self.w2_mxfp4: Mxfp4Weight | None = None
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
        ``w1`` gate, ``w3`` up or ``w2`` down), narrowed to this rank's slice
        (under expert parallelism: whole, and skipped unless this rank holds
        the expert); or (``shard`` a string, :data:`STACKED_SHARDS`, no
        expert parallelism) every expert's."""
        if isinstance(shard, str):
            self._load_stacked(param, loaded, shard)
            return
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

    def takes_mxfp4(self) -> bool:
        """Whether this rank's slice of MXFP4 projections is whole blocks of
        32 (H and this rank's I) and not expert-parallel (then
        :meth:`load_mxfp4` keeps them packed)."""
        inter = self.intermediate_size_per_partition
        return not self.use_ep and self.hidden_size % 32 == 0 and inter % 32 == 0

    def load_mxfp4(self, kind: str, weight: Mxfp4Weight) -> None:
        """Every expert's projection kept MXFP4, this rank's slice (``kind``
        "w13": HF's rows ``[E, 2I, H]``, gate and up rows interleaved, to
        this rank's gate rows then its up rows; "w2": ``[E, H, I]``, this
        rank's columns); the dense parameter released."""
        e, h = self.num_experts, self.hidden_size
        inter = self.intermediate_size_per_partition
        full, start = inter * self.tp_size, self.tp_rank * inter
        expected = (e, 2 * full, h) if kind == "w13" else (e, h, full)
        if kind not in ("w13", "w2") or weight.shape != expected or not self.takes_mxfp4():
            raise ModelLoadError(
                f"MXFP4 experts {kind}: shape {weight.shape} does not match the model's {expected}"
            )
        if kind == "w2":
            self.w2_mxfp4 = weight.narrow(2, start, inter) if self.tp_size > 1 else weight
            self.w2_weight.data = torch.empty(0, dtype=self.w2_weight.dtype)
            return
        rows = torch.arange(start, start + inter) * 2
        self.w13_mxfp4 = weight.rows(torch.cat((rows, rows + 1)))
        self.w13_weight.data = torch.empty(0, dtype=self.w13_weight.dtype)

    def unpack_mxfp4(self) -> None:
        """The packed projections dequantized into the dense parameters, in
        their dtype now (an op set that does not take MXFP4, or a model no
        longer float32), the packed ones dropped."""
        if self.w13_mxfp4 is not None:
            self.w13_weight.data = self.w13_mxfp4.dequantize().to(self.w13_weight.dtype)
            self.w13_mxfp4 = None
        if self.w2_mxfp4 is not None:
            self.w2_weight.data = self.w2_mxfp4.dequantize().to(self.w2_weight.dtype)
            self.w2_mxfp4 = None

    def packed_ops(self) -> TakesMxfp4Experts | None:
        """The op set, where the projections are kept MXFP4, it takes them
        and the model is float32 still; None otherwise (kept ones
        dequantized now, once)."""
        if self.w13_mxfp4 is None and self.w2_mxfp4 is None:
            return None
        ops = self.ops.ops
        float32 = self.w13_weight.dtype == torch.float32
        if float32 and isinstance(ops, TakesMxfp4Experts) and ops.takes_mxfp4_experts:
            return ops
        self.unpack_mxfp4()
        return None

    def forward(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        counted: bool = False,
    ) -> torch.Tensor:
        """The weighted sum of each row's experts. Under expert parallelism
        ``hidden`` holds this rank's share of the rows (see the module doc)
        and so does the result (no reduction). ``counted``: the router has
        added the rows to ``tokens_per_expert`` already."""
        if self.use_ep:
            return self.forward_ep(hidden, topk_weights, topk_ids)
        if not counted:
            ids = topk_ids.reshape(-1).long()
            self.tokens_per_expert.index_add_(0, ids, torch.ones_like(ids))
        w2_bias = self.w2_bias if self.tp_rank == 0 else None  # the reduced sum holds it once
        packed = self.packed_ops()
        if packed is not None:
            out = packed.fused_experts(
                hidden,
                self.w13_mxfp4 or self.w13_weight,
                self.w2_mxfp4 or self.w2_weight,
                topk_weights,
                topk_ids,
                self.activation,
                self.w13_bias,
                w2_bias,
            )
        else:
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

    def forward_ep(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch this rank's pairs to the experts' ranks, compute the pairs
        sent here on the local experts, combine the results back."""
        stage = ExpertParallelStage(self, hidden, topk_weights, topk_ids)
        stage.compute()
        return stage.finish()

    def compute_local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert, unweighted."""
        return self.ops.ops.fused_experts(
            rows,
            self.w13_weight,
            self.w2_weight,
            torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device),
            local_ids.to(torch.int32).unsqueeze(1),
        )


class ExpertParallelStage:
    """One pass of token rows through an expert-parallel :class:`FusedMoE`,
    in three calls so that a caller can run other work while each
    all-to-all is in flight: the constructor plans (one all-gather of the
    counts) and starts the dispatch; :meth:`compute` waits for it, runs the
    local experts and starts the combine; :meth:`finish` waits for that and
    returns the rows' weighted sums. Each call records its host interval
    (``time.time_ns() // 1000``) in :attr:`intervals_us` for the step
    timeline."""

    def __init__(
        self,
        experts: FusedMoE,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> None:
        self.experts, self.topk_weights = experts, topk_weights
        self.ep = get_ep_group()
        #: (name, start, end): ``dispatch`` (its start to the end of its
        #: wait), ``experts``, ``combine`` (likewise).
        self.intervals_us: list[tuple[str, int, int]] = []
        self._dispatch_start = _now_us()
        self.plan = expert_parallel.plan_dispatch(topk_ids, experts.num_experts, self.ep)
        experts.tokens_per_expert += self.plan.tokens_per_expert
        self._rows, self._work = expert_parallel.start_dispatch(
            hidden, topk_ids.shape[1], self.plan, self.ep
        )

    def compute(self) -> None:
        expert_parallel.wait(self._work)
        start = _now_us()
        self.intervals_us.append(("dispatch", self._dispatch_start, start))
        out = self.experts.compute_local(self._rows, self.plan.recv_expert_ids)
        self._back, self._work = expert_parallel.start_combine(out, self.plan, self.ep)
        self._combine_start = _now_us()
        self.intervals_us.append(("experts", start, self._combine_start))

    def finish(self) -> torch.Tensor:
        expert_parallel.wait(self._work)
        self.intervals_us.append(("combine", self._combine_start, _now_us()))
        return expert_parallel.weighted_sum(self._back, self.topk_weights, self.plan)


def _now_us() -> int:
    return time.time_ns() // 1000


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
            top_k=top_k,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            ops=self.ops,
            bias=bias,
            activation=activation,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.use_ep:
            return self.forward_ep(x)
        x = gather_tokens(x, self.sequence_parallel)
        counts = self.experts.tokens_per_expert
        return self.experts(x, *self.route(x, counts=counts), counted=True)

    def route(
        self, x: torch.Tensor, *, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``(topk_weights, topk_ids)``: the op set's
        :meth:`~asyncstep.ops.base.OpSet.select_experts` (the reference:
        :func:`select_experts`), each row's experts added to ``counts``
        where given."""
        return self.ops.ops.select_experts(
            self.gate(x),
            self.top_k,
            renormalize=self.renormalize,
            scoring_func=self.scoring_func,
            counts=counts,
        )

    def forward_ep(self, x: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: route and compute this rank's rows (its own
        under sequence parallelism, else its slice of the replicated rows,
        all-gathered after)."""
        stage = self.begin_ep(x)
        stage.compute()
        return stage.finish()

    def begin_ep(self, x: torch.Tensor) -> SparseMoeStage:
        """:meth:`forward_ep` in stages (:class:`SparseMoeStage`): routes this
        rank's rows and starts their dispatch."""
        return SparseMoeStage(self, x)


class SparseMoeStage(ExpertParallelStage):
    """:meth:`SparseMoeBlock.forward_ep` in :class:`ExpertParallelStage`'s
    three calls: this rank's share of ``x`` routed, the result put back
    together (all-gathered, or this rank's rows under sequence parallelism)."""

    def __init__(self, block: SparseMoeBlock, x: torch.Tensor) -> None:
        ep = get_ep_group()
        self.num_tokens, self.chunk = x.shape[0], 0
        self.gather = not block.sequence_parallel
        if self.gather:
            start, end, self.chunk = expert_parallel.local_rows(x.shape[0], ep)
            x = x[start:end]
        super().__init__(block.experts, x, *block.route(x))

    def finish(self) -> torch.Tensor:
        out = super().finish()
        if not self.gather:
            return out
        return expert_parallel.gather_rows(out, self.num_tokens, self.chunk, self.ep)
