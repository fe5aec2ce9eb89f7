"""The Triton kernels of a mixture-of-experts layer's routing and alignment
(:mod:`asyncstep.ops.triton.moe_routing` launches them and states the
contract).

* :func:`topk_route_kernel`: one program a token: the float32 scores of its
  router logits (softmax, sigmoid, or the logits themselves for
  "topk_softmax"), the top k by repeated arg-max (ties to the lower expert
  id, as torch's ``topk``; NaN above everything, each id once), then the
  weights (renormalised, or the softmax of the k logits), stored ``[T, k]``;
  where COUNT, each chosen expert's load counter incremented (an integer
  ``atomic_add``: exact in any order).
* :func:`align_count_kernel`: one program: each expert's pair count, its run
  padded to BLOCK_M and the runs' starts (a cumsum), every chunk of CHUNK
  pairs' first slot per expert, each block's expert, the padded total, and
  every slot of ``sorted_ids`` set to the pair count (padding).
* :func:`align_scatter_kernel`: one program a chunk: each pair's slot, its
  chunk's slot for its expert plus the pairs of that expert before it in
  the chunk, so each expert's run lists its pairs by p (a stable sort).

Pair ``p = t * top_k + j`` is ``topk_ids[t, j]`` read in place (any
strides). Everything is integer counting but the router's scores: the
outputs do not depend on launch order or on other tokens.

May import triton and :mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncstep.ops.triton.pdl import launch_then_wait

__all__ = [
    "SCORE_SIGMOID",
    "SCORE_SOFTMAX",
    "SCORE_TOPK_SOFTMAX",
    "align_count_kernel",
    "align_scatter_kernel",
    "topk_route_kernel",
]

#: ``SCORING`` values of :func:`topk_route_kernel`.
SCORE_SOFTMAX: tl.constexpr = tl.constexpr(0)
SCORE_SIGMOID: tl.constexpr = tl.constexpr(1)
SCORE_TOPK_SOFTMAX: tl.constexpr = tl.constexpr(2)


# stride_le never specialised (not to 1 either): a token's scores then sit in
# the same lanes whatever the logits' layout, so their sums (the softmax's)
# associate alike for a strided row and a contiguous one (the same bits).
@triton.jit(do_not_specialize=["stride_le"])
def topk_route_kernel(
    logits_ptr: tl.tensor,
    weights_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    E: tl.tensor,
    stride_lt: tl.tensor,
    stride_le: tl.tensor,
    stride_wt: tl.tensor,
    stride_it: tl.tensor,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    SCORING: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    COUNT: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(T,)``; E_PAD and K_PAD powers of two, at least E and TOP_K;
    weights float32 ``[T, k]`` and ids int32 ``[T, k]`` contiguous rows;
    counts int64 ``[E]`` contiguous (read where COUNT)."""
    launch_then_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, E_PAD)
    e_mask = es < E
    logits = tl.load(
        logits_ptr + t * stride_lt + es * stride_le, mask=e_mask, other=-float("inf")
    ).to(tl.float32)
    if SCORING == SCORE_SOFTMAX:
        shifted = tl.exp(logits - tl.max(logits, 0))
        scores = shifted / tl.sum(shifted, 0)
    elif SCORING == SCORE_SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        scores = logits
    # NaN ranks above everything (torch's topk); each id taken once, even
    # among equal (say -inf) scores: every id stays in [0, E).
    left = tl.where(scores != scores, float("inf"), scores)
    left = tl.where(e_mask, left, -float("inf"))
    free = e_mask
    ks = tl.arange(0, K_PAD)
    top = tl.zeros([K_PAD], tl.float32)
    top_ids = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(free, left, -float("inf")), 0)
        best_id = tl.min(tl.where(free & (left == best), es, E_PAD), 0)
        top = tl.where(ks == j, tl.sum(tl.where(es == best_id, scores, 0.0), 0), top)
        top_ids = tl.where(ks == j, best_id, top_ids)
        free = free & (es != best_id)
    k_mask = ks < TOP_K
    if SCORING == SCORE_TOPK_SOFTMAX:
        shifted = tl.where(
            k_mask, tl.exp(top - tl.max(tl.where(k_mask, top, -float("inf")), 0)), 0.0
        )
        top = shifted / tl.sum(shifted, 0)
    elif RENORMALIZE:
        top = top / tl.sum(tl.where(k_mask, top, 0.0), 0)
    tl.store(weights_ptr + t * stride_wt + ks, top, mask=k_mask)
    tl.store(ids_ptr + t * stride_it + ks, top_ids, mask=k_mask)
    if COUNT:
        ones = tl.full([K_PAD], 1, tl.int64)
        tl.atomic_add(counts_ptr + top_ids, ones, mask=k_mask, sem="relaxed")


@triton.jit
def _chunk_experts(
    ids_ptr: tl.tensor,
    c0: tl.tensor,
    num_pairs: tl.tensor,
    top_k: tl.tensor,
    stride_it: tl.tensor,
    stride_ij: tl.tensor,
    CHUNK: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Pairs ``c0 .. c0 + CHUNK``: (p, valid, expert; -1 past num_pairs)."""
    p = c0 + tl.arange(0, CHUNK)
    valid = p < num_pairs
    expert = tl.load(ids_ptr + (p // top_k) * stride_it + (p % top_k) * stride_ij, mask=valid)
    return p, valid, tl.where(valid, expert.to(tl.int32), -1)


@triton.jit
def _chunk_counts(expert: tl.tensor, E_PAD: tl.constexpr) -> tl.tensor:
    """Each expert's pairs in a chunk (``[E_PAD]`` int32; -1 counts nowhere)."""
    return tl.histogram(expert, E_PAD, mask=expert >= 0).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def align_count_kernel(
    ids_ptr: tl.tensor,
    chunk_base_ptr: tl.tensor,
    sorted_ids_ptr: tl.tensor,
    expert_ids_ptr: tl.tensor,
    padded_ptr: tl.tensor,
    num_pairs: tl.tensor,
    top_k: tl.tensor,
    E: tl.tensor,
    num_blocks: tl.tensor,
    stride_it: tl.tensor,
    stride_ij: tl.tensor,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_STEP: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(1,)``. chunk_base ``[chunks, E_PAD]`` int32: chunk c's first
    slot for expert e; sorted_ids ``[num_blocks * BLOCK_M]`` int32 all set
    to num_pairs; expert_ids ``[num_blocks]`` int32 (-1 past the last run);
    padded one int64."""
    launch_then_wait(PDL)
    es = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        _, _, expert = _chunk_experts(ids_ptr, c0, num_pairs, top_k, stride_it, stride_ij, CHUNK)
        counts += _chunk_counts(expert, E_PAD)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    run = ends - padded
    tl.store(padded_ptr, tl.sum(padded, 0).to(tl.int64))
    for c0 in range(0, num_pairs, CHUNK):
        tl.store(chunk_base_ptr + (c0 // CHUNK) * E_PAD + es, run)
        _, _, expert = _chunk_experts(ids_ptr, c0, num_pairs, top_k, stride_it, stride_ij, CHUNK)
        run += _chunk_counts(expert, E_PAD)
    # A block's expert: the experts whose runs end at or before its first slot.
    real = es < E
    for b0 in range(0, num_blocks, BLOCKS_STEP):
        bs = b0 + tl.arange(0, BLOCKS_STEP)
        done = (ends[None, :] <= (bs * BLOCK_M)[:, None]) & real[None, :]
        n = tl.sum(done.to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + bs, tl.where(n < E, n, -1), mask=bs < num_blocks)
    fill = tl.zeros([BLOCKS_STEP * BLOCK_M], tl.int32) + num_pairs
    for s0 in range(0, num_blocks * BLOCK_M, BLOCKS_STEP * BLOCK_M):
        slots = s0 + tl.arange(0, BLOCKS_STEP * BLOCK_M)
        tl.store(sorted_ids_ptr + slots, fill, mask=slots < num_blocks * BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs"])
def align_scatter_kernel(
    ids_ptr: tl.tensor,
    chunk_base_ptr: tl.tensor,
    sorted_ids_ptr: tl.tensor,
    num_pairs: tl.tensor,
    top_k: tl.tensor,
    stride_it: tl.tensor,
    stride_ij: tl.tensor,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(chunks,)``, after :func:`align_count_kernel`: ``sorted_ids[slot] = p``."""
    launch_then_wait(PDL)
    c = tl.program_id(0)
    p, valid, expert = _chunk_experts(
        ids_ptr, c * CHUNK, num_pairs, top_k, stride_it, stride_ij, CHUNK
    )
    base = tl.load(chunk_base_ptr + c * E_PAD + expert, mask=valid, other=0)
    cs = tl.arange(0, CHUNK)
    before = (expert[:, None] == expert[None, :]) & (cs[None, :] < cs[:, None])
    rank = tl.sum(before.to(tl.int32), axis=1)
    tl.store(sorted_ids_ptr + base + rank, p.to(tl.int32), mask=valid)
