"""The reference mixture-of-experts computation: torch's matmuls over the
token-expert pairs sorted by expert (one grouped matmul per step: a matmul
per expert's slice), on any device and dtype.

:func:`fused_experts` takes vLLM's arguments: ``hidden`` ``[T, H]``, ``w13``
``[E, 2 * I, H]`` (each expert's gate rows, then its up rows), ``w2``
``[E, H, I]``, ``topk_weights`` ``[T, k]`` float32 and ``topk_ids`` ``[T, k]``
int32, and optional biases ``w13_bias`` ``[E, 2 * I]`` and ``w2_bias``
``[E, H]`` (gpt-oss's experts), and returns ``sum_j topk_weights[t, j] *
expert_{topk_ids[t, j]}(hidden[t])`` ``[T, H]`` in ``hidden``'s dtype, where
``expert_e(x) = w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]`` (the down bias
added before the routing weight multiplies, as transformers' gpt-oss and the
Triton op :mod:`asyncstep.ops.triton.fused_moe` do). **w13 is the expert's I
gate rows, then its I up rows, for every activation** (an interleaved
gpt-oss checkpoint is converted once at load:
:func:`gate_up_from_interleaved`). The activations: ``"silu"``:
``silu(gate) * up``; ``"swigluoai"`` (gpt-oss): ``gate = min(gate, 7)``,
``up = clamp(up, -7, 7)``, ``(up + 1) * gate * sigmoid(1.702 * gate)``.
Under tensor parallelism ``I`` is
this rank's slice of every expert and the result a partial sum (the caller
reduces it; ``w2_bias`` is then added by one rank only: the caller passes
it on TP rank 0 alone). Each pair's output is weighted in float32 and the pairs of a
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
in every batch; with torch's ``F.linear`` it may differ by roundings with
the number of rows, as a dense layer's does. (The CPU op set's float32
experts do not come here: the library's grouped kernel,
:mod:`asyncstep.ops.cpu.moe`, computes each row alone.)

May import torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "ACTIVATIONS",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "activate",
    "experts_every_token",
    "fused_experts",
    "gate_up_from_interleaved",
    "select_experts",
    "sort_by_expert",
]

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The experts' activations (of ``[gate | up]`` rows).
ACTIVATIONS = ("silu", "swigluoai")
#: gpt-oss's swigluoai constants (``swiglu_alpha``, ``swiglu_limit``).
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def activate(gate_up: torch.Tensor, inter: int, activation: str) -> torch.Tensor:
    """The activation of ``gate_up`` rows ``[n, 2 * inter]`` (gate columns,
    then up columns): ``[n, inter]``."""
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


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
    ``renormalize`` (torch's ``topk``, as in transformers: its own order
    among exactly tied scores). "topk_softmax" (gpt-oss): the top ``k`` logits, then
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


def gate_up_from_interleaved(
    w13: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w13 ``[E, 2I, H]`` (and bias ``[E, 2I]``) with gate and up rows
    interleaved (gate at even positions: gpt-oss's ``gate_up_proj``
    transposed) as gate rows then up rows, new contiguous tensors (the
    Triton module's function, without importing triton)."""
    w = torch.cat((w13[:, 0::2], w13[:, 1::2]), dim=1).contiguous()
    b = None if bias is None else torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1).contiguous()
    return w, b


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
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    matmul: Matmul = F.linear,
) -> torch.Tensor:
    """The experts' weighted sum for every token (see the module doc);
    ``matmul(x, weight)``: ``x @ weight.T`` of one expert's 2-D weight."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_experts: unsupported activation {activation!r}")
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return experts_every_token(
            hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, matmul
        )
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
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
        # The expert's rows weighted straight into their slice (one pass:
        # the same float32 products as weighting the whole after).
        torch.mul(
            _expert(rows[start:end], expert, w13, w2, activation, w13_bias, w2_bias, matmul),
            weights[start:end],
            out=pair_out[start:end],
        )
        start = end
    out.index_add_(0, token_of_pair, pair_out)
    return out.to(hidden.dtype)


def experts_every_token(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    matmul: Matmul = F.linear,
) -> torch.Tensor:
    """:func:`fused_experts` without a host sync (see the module doc)."""
    num_experts = w13.shape[0]
    weights = torch.zeros(
        hidden.shape[0], num_experts, dtype=torch.float32, device=hidden.device
    ).scatter_(1, topk_ids.long(), topk_weights.float())
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(num_experts):
        expert_out = _expert(hidden, expert, w13, w2, activation, w13_bias, w2_bias, matmul)
        out += weights[:, expert : expert + 1] * expert_out
    return out.to(hidden.dtype)


def _expert(
    rows: torch.Tensor,
    expert: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    matmul: Matmul,
) -> torch.Tensor:
    """One expert over its ``rows``: float32 ``[n, H]``, the down bias added."""
    gate_up = matmul(rows, w13[expert])
    if w13_bias is not None:
        gate_up = gate_up + w13_bias[expert].to(gate_up.dtype)
    act = activate(gate_up, w2.shape[2], activation)
    out = matmul(act, w2[expert]).float()
    if w2_bias is not None:
        out = out + w2_bias[expert].float()
    return out
