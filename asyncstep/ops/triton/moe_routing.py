"""A mixture-of-experts layer's routing and the pairs' alignment in Triton
(issue 41): a layer's routing is one launch and its alignment two, where
torch's ops took about fifteen small kernels; no host sync, every grid sized
from shapes alone, so a CUDA graph captures them.

* :func:`topk_route`: :func:`~asyncstep.ops.torch_moe.select_experts`'
  contract (``(topk_weights [T, k] float32, topk_ids [T, k] int32)``; the
  top k of the float32 softmax or sigmoid of the router logits, ties to the
  lower expert id, renormalised where asked; "topk_softmax": the softmax of
  the top k logits) in one kernel, a program a token: a token's routing
  does not depend on the others. It adds each token's experts to a layer's
  load counter too, where given (no launch of its own).
* :func:`moe_align_block_size`: the pairs ``p = t * k + j`` of ``topk_ids``
  listed by expert, each expert's run padded to block_m
  (:class:`MoeAlignment`), the same tensors as :func:`torch_align_block_size`
  (the torch ops it replaces, kept as the reference): a count kernel (one
  program) and a scatter kernel (a program per CHUNK pairs), up to
  :data:`ALIGN_KERNEL_MAX_PAIRS` pairs (a decode step's, a short prompt's);
  past them the torch ops.

Every kernel launches with programmatic dependent launch where the GPU has
it (:mod:`asyncstep.ops.triton.pdl`).

May import torch, triton, :mod:`asyncstep.ops.triton.moe_routing_kernels` and
:mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from asyncstep.ops.triton import moe_routing_kernels as kernels
from asyncstep.ops.triton import pdl

__all__ = [
    "ALIGN_KERNEL_MAX_PAIRS",
    "SCORING",
    "MoeAlignment",
    "max_blocks",
    "moe_align_block_size",
    "topk_route",
    "torch_align_block_size",
]

#: The router's scorings and their kernel codes.
SCORING = {
    "softmax": kernels.SCORE_SOFTMAX.value,
    "sigmoid": kernels.SCORE_SIGMOID.value,
    "topk_softmax": kernels.SCORE_TOPK_SOFTMAX.value,
}

#: Pairs a scatter program takes (its rank matrix is CHUNK x CHUNK).
CHUNK = 128
#: Blocks (and BLOCK_M-slot runs of sorted_ids) the count kernel writes a step.
BLOCKS_STEP = 64
#: The most pairs :func:`moe_align_block_size` aligns with the kernels: the
#: count kernel is one program whose loops grow with the pairs (two passes
#: of CHUNK pairs a step), so a long prompt's alignment takes torch's sort
#: (tens of launches, but each wide). On one H100 (``fused_moe_kernel.py
#: --routing``) the kernels still led at 16,384 pairs (114 against 169 us,
#: qwen3-30b-a3b) and trailed at 65,536 (485 against 204): the crossover
#: lies between, above this bound.
ALIGN_KERNEL_MAX_PAIRS = 4096


@dataclass(frozen=True)
class MoeAlignment:
    """The pairs by expert: ``sorted_ids [max_blocks * block_m]`` (int32)
    holds pair indices, each expert's run starting at a multiple of block_m,
    padding entries equal to ``num_pairs``; ``expert_ids [max_blocks]``
    (int32) is each block's expert, -1 past the last run; ``padded_pairs``
    (a 1-element int64 tensor) is the padded runs' total."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    padded_pairs: torch.Tensor
    num_pairs: int
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded blocks of ``num_pairs`` pairs over
    ``num_experts`` experts: each expert that has pairs pads fewer than
    block_m entries, and at most ``min(E, pairs)`` experts have pairs."""
    padding = min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(num_pairs + padding, block_m)


def topk_route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts (see the module doc): ``router_logits [T, E]``
    of any float dtype and strides; ``counts`` (int64 ``[E]``, contiguous,
    on the logits' device), where given: each chosen expert's entry plus
    one a token. ValueError for a scoring it does not know, a top_k outside
    ``[1, E]`` or counts that do not fit."""
    if scoring_func not in SCORING:
        raise ValueError(f"unsupported router scoring {scoring_func!r}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if counts is not None and (
        counts.dtype != torch.int64
        or tuple(counts.shape) != (num_experts,)
        or not counts.is_contiguous()
        or counts.device != router_logits.device
    ):
        raise ValueError(
            f"counts must be contiguous int64 [{num_experts}] on {router_logits.device}, "
            f"got {counts.dtype} {tuple(counts.shape)} on {counts.device}"
        )
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    kernels.topk_route_kernel[(num_tokens,)](
        router_logits,
        weights,
        ids,
        counts if counts is not None else ids,  # any pointer: COUNT is off
        num_experts,
        *router_logits.stride(),
        weights.stride(0),
        ids.stride(0),
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts),
        SCORING=SCORING[scoring_func],
        RENORMALIZE=renormalize,
        COUNT=counts is not None,
        num_warps=_route_warps(num_experts),
        **pdl.launch_kwargs(router_logits),
    )
    return weights, ids


def _route_warps(num_experts: int) -> int:
    """A routing program's warps: one up to 256 experts (its top-k's 3 k
    reductions a token stay within a warp: shuffles, no shared memory or
    barrier), else 4."""
    return 1 if num_experts <= 256 else 4


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    kernel_max_pairs: int = ALIGN_KERNEL_MAX_PAIRS,
) -> MoeAlignment:
    """Sort the pairs ``p = t * k + j`` of ``topk_ids [T, k]`` (int32 or
    int64, any strides, each in ``[0, E)``) by expert, stably (within an
    expert by p), and pad each expert's run to a multiple of block_m (vLLM's
    ``moe_align_block_size``): two kernels, no host sync; past
    ``kernel_max_pairs`` pairs :func:`torch_align_block_size` (the same
    tensors)."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    if num_pairs > kernel_max_pairs:
        return torch_align_block_size(topk_ids, num_experts, block_m)
    blocks = max_blocks(num_pairs, num_experts, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    chunks = triton.cdiv(num_pairs, CHUNK)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=device)
    padded = torch.empty(1, dtype=torch.int64, device=device)
    chunk_base = torch.empty((max(chunks, 1), e_pad), dtype=torch.int32, device=device)
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    strides = topk_ids.stride() if topk_ids.dim() == 2 else (1, 0)
    kernels.align_count_kernel[(1,)](
        topk_ids,
        chunk_base,
        sorted_ids,
        expert_ids,
        padded,
        num_pairs,
        top_k,
        num_experts,
        blocks,
        *strides,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=CHUNK,
        BLOCKS_STEP=BLOCKS_STEP,
        **pdl.launch_kwargs(topk_ids),
    )
    if chunks:
        kernels.align_scatter_kernel[(chunks,)](
            topk_ids,
            chunk_base,
            sorted_ids,
            num_pairs,
            top_k,
            *strides,
            E_PAD=e_pad,
            CHUNK=CHUNK,
            **pdl.launch_kwargs(topk_ids),
        )
    return MoeAlignment(sorted_ids, expert_ids, padded, num_pairs, block_m)


def torch_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """:func:`moe_align_block_size` in torch ops (sort, searchsorted, cumsum,
    ...: about fifteen launches), no host sync: the reference."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    experts_sorted, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(
        experts_sorted, torch.arange(num_experts + 1, device=device, dtype=torch.int64)
    )
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    rank = torch.arange(num_pairs, device=device) - bounds[experts_sorted]
    sorted_ids = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[starts[experts_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(blocks, device=device, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return MoeAlignment(sorted_ids, expert_ids, ends[-1:], num_pairs, block_m)
