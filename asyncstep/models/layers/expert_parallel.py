"""Expert parallelism's token exchange: each rank of the EP group holds
``num_experts / ep_size`` whole experts (rank ``r``: the experts
``[r * E / ep, (r + 1) * E / ep)``), routes its own token rows, sends each
token-expert pair's row to the rank holding that expert (all-to-all), and
gets the experts' outputs back (all-to-all) to weight and sum them.

Contracts:

* :func:`local_rows`: without sequence parallelism every TP rank holds every
  token row; rank ``r`` routes the rows ``[r * c, min((r + 1) * c, T))``,
  ``c = ceil(T / ep)`` (the last ranks may have fewer, or none), and
  :func:`gather_rows` puts the ranks' results back together (all-gather of
  ``c`` rows each, the padding dropped). Under sequence parallelism each rank
  routes the rows it holds and keeps its results: no gather.
* :func:`plan_dispatch`: one all-gather of each rank's per-expert pair
  counts (``[ep, E]`` int64) gives every rank the split sizes of both
  all-to-alls and the step's tokens per expert over the whole group (read on
  the host: a sync, so an EP layer is not CUDA-graph capturable). A rank's
  pairs are sent sorted by their global expert id (stably), so the rows a
  rank receives from each source come grouped by its local experts, in
  order: their local expert ids follow from the counts, no ids are sent.
* :func:`combine`: each pair's output comes back in the order it was sent;
  the pairs of a token are weighted in float32 and summed (``index_add_``)
  in the order of their experts, then rounded once: the same sums in the
  same order as :func:`~asyncstep.ops.torch_moe.fused_experts` on one rank.
* The all-to-alls are started asynchronously
  (:meth:`~asyncstep.channels.parallel_state.GroupCoordinator.all_to_all_async`):
  :func:`start_dispatch` and :func:`start_combine` return the Work to wait
  (:func:`wait`) before the result is read, so that a caller may compute
  something else meanwhile (the other micro-batch's experts:
  :mod:`asyncstep.runner.ubatch_forward`).

May import torch and :mod:`asyncstep.channels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import Work

from asyncstep.channels.parallel_state import GroupCoordinator

__all__ = [
    "DispatchPlan",
    "gather_rows",
    "local_rows",
    "plan_dispatch",
    "start_combine",
    "start_dispatch",
    "wait",
    "weighted_sum",
]


def local_rows(num_tokens: int, ep: GroupCoordinator) -> tuple[int, int, int]:
    """This rank's share of ``num_tokens`` replicated rows: ``(start, end,
    chunk)`` (see the module doc)."""
    chunk = -(-num_tokens // ep.world_size)
    start = min(ep.rank_in_group * chunk, num_tokens)
    return start, min(start + chunk, num_tokens), chunk


def gather_rows(
    out: torch.Tensor, num_tokens: int, chunk: int, ep: GroupCoordinator
) -> torch.Tensor:
    """Every rank's rows of :func:`local_rows`, concatenated: ``[num_tokens, H]``."""
    if ep.world_size == 1:
        return out
    padded = out.new_zeros(chunk, *out.shape[1:])
    padded[: out.shape[0]] = out
    return ep.all_gather(padded, dim=0)[:num_tokens]


@dataclass(frozen=True)
class DispatchPlan:
    """Where this rank's token-expert pairs go and what comes back."""

    #: This rank's pairs (indices into the flattened ``[T, k]``), sorted by
    #: global expert id (stably): the order they are sent in.
    order: torch.Tensor
    #: Rows sent to each rank / received from each rank.
    send_splits: list[int]
    recv_splits: list[int]
    #: The local expert id of each row received (``[sum(recv_splits)]``).
    recv_expert_ids: torch.Tensor
    #: The pairs routed to each expert by the whole group this step (``[E]``).
    tokens_per_expert: torch.Tensor


def plan_dispatch(topk_ids: torch.Tensor, num_experts: int, ep: GroupCoordinator) -> DispatchPlan:
    """The plan of this rank's pairs ``topk_ids`` ``[T, k]`` (global expert
    ids): one all-gather of the per-expert counts (see the module doc)."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    every = ep.all_gather(counts.unsqueeze(0), dim=0)  # [ep, E]
    per_rank = num_experts // ep.world_size
    table = every.view(ep.world_size, ep.world_size, per_rank)  # [source, owner, local expert]
    me = ep.rank_in_group
    host = table.tolist()
    send_splits = [sum(host[me][owner]) for owner in range(ep.world_size)]
    recv_splits = [sum(host[source][me]) for source in range(ep.world_size)]
    local = torch.arange(per_rank, device=topk_ids.device)
    recv_ids = torch.repeat_interleave(local.repeat(ep.world_size), table[:, me, :].reshape(-1))
    return DispatchPlan(order, send_splits, recv_splits, recv_ids, every.sum(dim=0))


def start_dispatch(
    hidden: torch.Tensor, top_k: int, plan: DispatchPlan, ep: GroupCoordinator
) -> tuple[torch.Tensor, Work | None]:
    """Start sending each pair's token row to its expert's rank: (the rows
    this rank's experts will compute, ``[sum(plan.recv_splits), H]``, their
    local expert ids ``plan.recv_expert_ids``; the Work to wait first)."""
    rows = hidden.index_select(0, plan.order // top_k)
    return ep.all_to_all_async(rows, plan.recv_splits, plan.send_splits)


def start_combine(
    expert_out: torch.Tensor, plan: DispatchPlan, ep: GroupCoordinator
) -> tuple[torch.Tensor, Work | None]:
    """Start sending each computed row back to its token's rank: (the rows
    in the order this rank sent its pairs; the Work to wait first)."""
    return ep.all_to_all_async(expert_out, plan.send_splits, plan.recv_splits)


def weighted_sum(
    back: torch.Tensor, topk_weights: torch.Tensor, plan: DispatchPlan
) -> torch.Tensor:
    """Each token's pairs, weighted in float32 and summed in the order of
    their experts, rounded once: ``[T, H]`` in ``back``'s dtype."""
    num_tokens, top_k = topk_weights.shape
    weights = topk_weights.reshape(-1).index_select(0, plan.order).float().unsqueeze(1)
    out = torch.zeros(num_tokens, back.shape[1], dtype=torch.float32, device=back.device)
    out.index_add_(0, plan.order // top_k, back.float() * weights)
    return out.to(back.dtype)


def wait(work: Work | None) -> None:
    """Block until ``work`` is done (None: nothing in flight)."""
    if work is not None:
        work.wait()
