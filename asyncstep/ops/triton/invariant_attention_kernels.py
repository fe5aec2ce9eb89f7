"""The Triton kernels of the batch-invariant paged attention (issue 40),
launched by :mod:`asyncstep.ops.triton.invariant_attention`.

The per-query reduction order, the same for a decode, a verify step, a
prompt chunk and a whole prompt: a query at position p sees keys ``0 ..
p``, cut into *splits* of ``SPLIT`` keys (fixed: the number of splits
follows p, never the batch); a split's keys go through one online softmax
(float32) from a fresh state, ``TILE_N`` keys at a time from the split's
start; the splits' results ``(lse, part)`` are then folded in split order
by :func:`_merge_split`. A query is a row of a *query tile* (``BLOCK_Q``
consecutive queries of one request, times the ``GROUP`` heads of a KV
head: ``BLOCK_M`` rows, fixed for the engine): the tile reads keys up to
its last query's end, and the keys past a row's own end are masked, which
leaves that row's running sums exactly as they are (a weight of 0 adds
nothing, a scale of ``exp2(0)`` is 1). So a row's bits depend only on its
request's keys, not on the tile's other rows nor on the grid. A sliding
window (``WINDOW > 0``) masks a row's keys before its window the same way:
every split is still computed (a split the row sees nothing of folds in as
nothing), so the blocks before a window are read (whatever they hold: the
KV cache manager may have given them to another request) and masked.
Attention sinks (``SINKS``): the fold starts from the row's head's sink
(maximum ``sink * log2(e)``, weight sum 1) instead of from nothing, in both
launches, so a sink layer's rows keep these properties.

:func:`_invariant_attention_kernel`, grid ``(tiles, num_kv_heads,
splits)``, tiles numbered as in :mod:`asyncstep.ops.triton.attention_kernels`:
with ``PARALLEL`` one program per split writes the split's rows to scratch
(``part``, ``lse``) and :func:`_invariant_combine_kernel` (grid ``(tokens,
num_kv_heads)``) folds each token's own splits; without it one program per tile
folds its splits in a loop and writes ``out``. Both fold with the same
helper and are launched without floating-point contraction, so the two
paths give the same bits. Padding rows (past ``qsl[num_reqs]``) are zeros.

May import triton and :mod:`asyncstep.ops.triton`'s attention kernels and
:mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncstep.ops.triton.attention_kernels import (
    _attend_keys,
    _find_request,
    _softmax_start,
    _store_rows,
    _tile_start,
)
from asyncstep.ops.triton.decode_kernels import _decode_token
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior


@triton.jit
def _attend_split(
    q: tl.tensor,
    q_pos: tl.tensor,
    bt_row_ptr: tl.tensor,
    stride_btb: tl.tensor,
    k_head_ptr: tl.tensor,
    v_head_ptr: tl.tensor,
    stride_cb: tl.tensor,
    stride_cs: tl.tensor,
    stride_cd: tl.tensor,
    split_start: tl.tensor,
    split_end: tl.tensor,
    scale_log2: tl.tensor,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
) -> tuple[tl.tensor, tl.tensor]:
    """One split's ``(lse, part)`` per row: keys ``split_start ..
    split_end`` (causal per row; with a WINDOW, only the row's last WINDOW),
    log2-sum-exp and the normalised output; a row that sees none of them:
    lse -inf, part zeros."""
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(split_start, split_end, TILE_N):
        m_i, l_i, acc = _attend_keys(
            q,
            m_i,
            l_i,
            acc,
            q_pos,
            bt_row_ptr,
            stride_btb,
            k_head_ptr,
            v_head_ptr,
            stride_cb,
            stride_cs,
            stride_cd,
            start,
            split_end,
            scale_log2,
            True,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_SIZE,
            TILE_N,
            DOT_PRECISION,
            WINDOW,
        )
    seen = l_i > 0.0
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = acc / tl.where(seen, l_i, 1.0)[:, None]
    return lse, part


@triton.jit
def _merge_split(
    m: tl.tensor, total: tl.tensor, acc: tl.tensor, lse: tl.tensor, part: tl.tensor
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Fold one split into the running maximum, weight sum and output
    ``(m, total, acc)`` (m starts finite: an empty split, lse -inf, changes
    nothing)."""
    m_new = tl.maximum(m, lse)
    alpha = tl.exp2(m - m_new)
    weight = tl.exp2(lse - m_new)
    return m_new, total * alpha + weight, acc * alpha[:, None] + part * weight[:, None]


# num_tokens/num_reqs change every step: no variant per value (1, multiples of 16).
@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _invariant_attention_kernel(
    q_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    bt_ptr: tl.tensor,
    scale_log2: tl.tensor,
    sinks_ptr: tl.tensor,
    num_tokens: tl.tensor,
    num_reqs: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_qd: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_od: tl.tensor,
    stride_pt: tl.tensor,
    stride_ph: tl.tensor,
    stride_ps: tl.tensor,
    stride_pd: tl.tensor,
    stride_lt: tl.tensor,
    stride_lh: tl.tensor,
    stride_c: tl.tensor,
    stride_ch: tl.tensor,
    stride_cb: tl.tensor,
    stride_cs: tl.tensor,
    stride_cd: tl.tensor,
    stride_btr: tl.tensor,
    stride_btb: tl.tensor,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PARALLEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(tiles, num_kv_heads, splits)``: a query tile's splits (see
    the module docstring); spare tile numbers zero the padding rows (not
    PARALLEL; the combine kernel does it otherwise). ``PDL``: launched with
    programmatic dependent launch (:mod:`asyncstep.ops.triton.pdl`)."""
    launch_dependents(PDL)
    wait_prior(PDL)  # the KV store before may still be writing q and the cache
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    in_tile = rows // GROUP  # the row's query token within the tile
    heads = kv_head * GROUP + rows % GROUP
    tiles_used = _tile_start(qsl_ptr, num_reqs, BLOCK_Q)
    if tile < tiles_used:
        req = _find_request(qsl_ptr, num_reqs, tile, BLOCK_Q)
        q_start = tl.load(qsl_ptr + req)
        q_len = tl.load(qsl_ptr + req + 1) - q_start
        first = (tile - _tile_start(qsl_ptr, req, BLOCK_Q)) * BLOCK_Q
        if first < q_len:
            q_idx = first + in_tile
            row_mask = (in_tile < BLOCK_Q) & (q_idx < q_len)
            tokens = q_start + q_idx
            seq_len = tl.load(seq_lens_ptr + req)
            q_pos = seq_len - q_len + q_idx  # key j is visible to this row iff j <= q_pos
            dims = tl.arange(0, HEAD_DIM_PAD)
            q_ptrs = (
                q_ptr
                + tokens.to(tl.int64)[:, None] * stride_qt
                + heads[:, None] * stride_qh
                + dims[None, :] * stride_qd
            )
            q = tl.load(q_ptrs, mask=row_mask[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
            keys_end = tl.minimum(seq_len - q_len + first + BLOCK_Q, seq_len)
            bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_btr
            k_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_ch
            v_head_ptr = k_head_ptr + stride_c
            if PARALLEL:
                split_start = split * SPLIT
                if split_start < keys_end:
                    lse, part = _attend_split(
                        q,
                        q_pos,
                        bt_row_ptr,
                        stride_btb,
                        k_head_ptr,
                        v_head_ptr,
                        stride_cb,
                        stride_cs,
                        stride_cd,
                        split_start,
                        tl.minimum(split_start + SPLIT, keys_end),
                        scale_log2,
                        BLOCK_M,
                        HEAD_DIM,
                        HEAD_DIM_PAD,
                        BLOCK_SIZE,
                        TILE_N,
                        DOT_PRECISION,
                        WINDOW,
                    )
                    _store_rows(
                        part_ptr + split.to(tl.int64) * stride_ps,
                        part,
                        tokens,
                        heads,
                        row_mask,
                        stride_pt,
                        stride_ph,
                        stride_pd,
                        HEAD_DIM,
                        HEAD_DIM_PAD,
                    )
                    lse_ptrs = lse_ptr + tokens.to(tl.int64) * stride_lt + heads * stride_lh + split
                    tl.store(lse_ptrs, lse, mask=row_mask)
            else:
                m, total = _softmax_start(sinks_ptr, heads, SINKS, BLOCK_M)
                acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
                for split_start in range(0, keys_end, SPLIT):
                    lse, part = _attend_split(
                        q,
                        q_pos,
                        bt_row_ptr,
                        stride_btb,
                        k_head_ptr,
                        v_head_ptr,
                        stride_cb,
                        stride_cs,
                        stride_cd,
                        split_start,
                        tl.minimum(split_start + SPLIT, keys_end),
                        scale_log2,
                        BLOCK_M,
                        HEAD_DIM,
                        HEAD_DIM_PAD,
                        BLOCK_SIZE,
                        TILE_N,
                        DOT_PRECISION,
                        WINDOW,
                    )
                    m, total, acc = _merge_split(m, total, acc, lse, part)
                acc = acc / tl.where(total > 0.0, total, 1.0)[:, None]
                _store_rows(
                    out_ptr,
                    acc,
                    tokens,
                    heads,
                    row_mask,
                    stride_ot,
                    stride_oh,
                    stride_od,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                )
    elif not PARALLEL:
        # Padding rows qsl[num_reqs]..num_tokens, BLOCK_Q tokens per spare program.
        tokens = tl.load(qsl_ptr + num_reqs) + (tile - tiles_used) * BLOCK_Q + in_tile
        _store_rows(
            out_ptr,
            tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32),
            tokens,
            heads,
            (in_tile < BLOCK_Q) & (tokens < num_tokens),
            stride_ot,
            stride_oh,
            stride_od,
            HEAD_DIM,
            HEAD_DIM_PAD,
        )


@triton.jit(do_not_specialize=["num_reqs"])
def _invariant_combine_kernel(
    out_ptr: tl.tensor,
    part_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    sinks_ptr: tl.tensor,
    num_reqs: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_od: tl.tensor,
    stride_pt: tl.tensor,
    stride_ph: tl.tensor,
    stride_ps: tl.tensor,
    stride_pd: tl.tensor,
    stride_lt: tl.tensor,
    stride_lh: tl.tensor,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(num_tokens, num_kv_heads)``: ``out[t, heads of kv_head]`` from
    token t's own splits, folded in order by :func:`_merge_split` (the same
    arithmetic per element as the tile loop's). Padding rows zeros.
    ``PDL``: as the attention kernel's."""
    launch_dependents(PDL)
    wait_prior(PDL)  # the split programs' parts first
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows % GROUP
    tokens = tl.zeros_like(rows) + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    result = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    if token < tl.load(qsl_ptr + num_reqs):
        _, keys_end = _decode_token(qsl_ptr, seq_lens_ptr, num_reqs, token)
        m, total = _softmax_start(sinks_ptr, heads, SINKS, GROUP_PAD)
        lse_ptrs = lse_ptr + token.to(tl.int64) * stride_lt + heads.to(tl.int64) * stride_lh
        part_ptrs = (
            part_ptr
            + token.to(tl.int64) * stride_pt
            + heads.to(tl.int64)[:, None] * stride_ph
            + dims[None, :] * stride_pd
        )
        part_mask = row_mask[:, None] & dim_mask[None, :]
        for split in range(0, (keys_end + SPLIT - 1) // SPLIT):
            lse = tl.load(lse_ptrs + split, mask=row_mask, other=float("-inf"))
            part = tl.load(part_ptrs + split * stride_ps, mask=part_mask, other=0.0)
            m, total, result = _merge_split(m, total, result, lse, part)
        result = result / tl.where(total > 0.0, total, 1.0)[:, None]
    _store_rows(
        out_ptr,
        result,
        tokens,
        heads,
        row_mask,
        stride_ot,
        stride_oh,
        stride_od,
        HEAD_DIM,
        HEAD_DIM_PAD,
    )
