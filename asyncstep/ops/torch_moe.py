"""The reference mixture-of-experts computation: torch's matmuls over the
token-expert pairs sorted by expert (one grouped matmul per step: a matmul
per expert's slice), on any device and dtype.

:func:`fused_experts` takes vLLM's arguments: ``hidden`` ``[T, H]``, ``w13``
``[E, 2 * I, H]`` (each expert's gate rows, then its up rows), ``w2``
``[E, H, I]``, ``topk_weights`` ``[T, k]`` float32 and ``topk_ids`` ``[T, k]``
int32, and returns ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``
``[T, H]`` in ``hidden``'s dtype, where ``expert_e(x) = w2[e] @ (silu(w13[e]
gate rows @ x) * (w13[e] up rows @ x))``. Under tensor parallelism ``I`` is
this rank's slice of every expert and the result a partial sum (the caller
reduces it). Each pair's output is weighted in float32 and the pairs of a
token summed in float32, in the order of their experts (``index_add_`` over
the pairs sorted by expert, stably), then rounded once.

The sort reads each expert's row count on the host (a sync): while a CUDA
graph is being captured, which allows none, :func:`experts_every_token`
runs instead (every expert over every token, weighted 0 where the token did
not pick it: the same sums in the same order, ``num_experts / k`` times the
work).

The matmul is ``F.linear`` unless the caller passes its own (``matmul(x,
weight)`` of one expert's 2-D weight: the CPU op set passes its linear).

Batch invariance: a token's pairs are summed in the order of their experts
whatever the other tokens are, so its result depends on the other tokens
only through the matmul: each expert's matmul takes the rows routed to it in
this step, as many as the batch sends it. With a matmul that computes each
row alone in one order of K (the CPU library's dense bfloat16 matmul, which
the CPU op set runs under ``batch_invariant``) a token's output is the same
in every batch; with torch's ``F.linear`` (float32 on the CPU, every dtype
elsewhere) it may differ by roundings with the number of rows, as a dense
layer's does.

May import torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "experts_every_token", "fused_experts", "sort_by_expert"]

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The experts' activations: ``act(gate) * up``.
ACTIVATIONS = ("silu",)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-expert pairs sorted by expert, stably: (each sorted pair's
    index into the flattened ``[T * k]`` pairs, each expert's pair count
    ``[num_experts]``)."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    matmul: Matmul = F.linear,
) -> torch.Tensor:
    """The experts' weighted sum for every token (see the module doc);
    ``matmul(x, weight)``: ``x @ weight.T`` of one expert's 2-D weight."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_experts: unsupported activation {activation!r}")
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return experts_every_token(hidden, w13, w2, topk_weights, topk_ids, matmul)
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    order, counts = sort_by_expert(topk_ids, num_experts)
    token_of_pair = order // top_k
    rows = hidden.index_select(0, token_of_pair)
    weights = topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(1)
    pair_out = torch.empty(
        order.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device
    )
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        end = start + count
        gate_up = matmul(rows[start:end], w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        pair_out[start:end] = matmul(act, w2[expert]).float()
        start = end
    out.index_add_(0, token_of_pair, pair_out * weights)
    return out.to(hidden.dtype)


def experts_every_token(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    matmul: Matmul = F.linear,
) -> torch.Tensor:
    """:func:`fused_experts` without a host sync (see the module doc)."""
    num_experts, inter = w13.shape[0], w2.shape[2]
    weights = torch.zeros(
        hidden.shape[0], num_experts, dtype=torch.float32, device=hidden.device
    ).scatter_(1, topk_ids.long(), topk_weights.float())
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(num_experts):
        gate_up = matmul(hidden, w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out += weights[:, expert : expert + 1] * matmul(act, w2[expert]).float()
    return out.to(hidden.dtype)
