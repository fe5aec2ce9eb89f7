"""The split-KV ("flash decoding") Triton kernel for decode batches, whose
last program of each token and KV head combines their segments; launched by
:mod:`asyncstep.ops.triton.attention` (the scheme is described in
:mod:`asyncstep.ops.triton.attention_kernels`).

May import triton and asyncstep.ops.triton.pdl only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncstep.ops.triton.attention_kernels import _find_request, _softmax_start, _store_rows
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior

# --------------------------------------------------------------------------
# paged_attention: decode batches, keys split across programs


@triton.jit
def _decode_token(
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    num_reqs: tl.tensor,
    token: tl.tensor,
) -> tuple[tl.tensor, tl.tensor]:
    """The request of query token ``token`` (``< qsl[num_reqs]``) and the number
    of keys it sees (causal: up to and including its own position). Any
    query lengths; found at once where request ``token`` owns just token
    ``token`` (a decode batch), else by a binary search."""
    req = token
    own = token < num_reqs  # (past it, qsl has no entry token + 1)
    q_start = tl.load(qsl_ptr + token, mask=own, other=-1)
    q_end = tl.load(qsl_ptr + token + 1, mask=own, other=-1)
    # Fast path, every request one token: request `token` owns token `token`.
    if (q_start != token) | (q_end != token + 1):
        req = _find_request(qsl_ptr, num_reqs, token, 1)
        q_start = tl.load(qsl_ptr + req)
        q_end = tl.load(qsl_ptr + req + 1)
    seq_len = tl.load(seq_lens_ptr + req)
    return req, seq_len - q_end + token + 1


@triton.jit
def _segment_len(keys: tl.tensor, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr) -> tl.tensor:
    """Keys per segment: ``cdiv(keys, NUM_SPLITS)`` rounded up to the key tile."""
    per_split = (keys + NUM_SPLITS - 1) // NUM_SPLITS
    return (per_split + TILE_N - 1) // TILE_N * TILE_N


@triton.jit
def _decode_keys(
    q: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    bt_row_ptr: tl.tensor,
    stride_btb: tl.tensor,
    k_head_ptr: tl.tensor,
    v_head_ptr: tl.tensor,
    stride_cb: tl.tensor,
    stride_cs: tl.tensor,
    stride_cd: tl.tensor,
    start: tl.tensor,
    keys_end: tl.tensor,
    scale_log2: tl.tensor,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One online-softmax step of a decode row block over keys ``start ..
    start + TILE_N`` (those at or past ``keys_end`` hidden when MASKED).

    Unlike :func:`_attend_keys`, the block ids are read once for K and V and
    both tiles are loaded before any arithmetic, so their reads overlap."""
    keys = start + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    if MASKED:
        key_mask = keys < keys_end
        blocks = tl.load(bt_row_ptr + (keys // BLOCK_SIZE) * stride_btb, mask=key_mask, other=0)
    else:
        key_mask = keys >= 0  # all true
        blocks = tl.load(bt_row_ptr + (keys // BLOCK_SIZE) * stride_btb)
    rows = blocks.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE).to(tl.int64) * stride_cs
    k_ptrs = k_head_ptr + rows[None, :] + dims[:, None] * stride_cd  # [HEAD_DIM_PAD, TILE_N]
    v_ptrs = v_head_ptr + rows[:, None] + dims[None, :] * stride_cd  # [TILE_N, HEAD_DIM_PAD]
    if MASKED or HEAD_DIM != HEAD_DIM_PAD:
        k = tl.load(k_ptrs, mask=key_mask[None, :] & dim_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(key_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _norm_head_rows(
    x: tl.tensor,
    x_partner: tl.tensor,
    w_ptr: tl.tensor,
    dims: tl.tensor,
    partner: tl.tensor,
    dim_mask: tl.tensor,
    eps: tl.tensor,
    HEAD_DIM: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """Rows ``x`` (heads, ``[rows, HEAD_DIM_PAD]``, zeros past HEAD_DIM) and
    ``x_partner`` (the same rows at the rotary's partner features)
    RMSNormed per row with weight ``w``, in float32, rounded to x's dtype."""
    w = tl.load(w_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=dim_mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)
    normed = xf * inv_rms[:, None] * w[None, :]
    normed_partner = x_partner.to(tl.float32) * inv_rms[:, None] * w_partner[None, :]
    return normed.to(x.dtype), normed_partner.to(x.dtype)


# num_reqs changes every step: no variant per value (1, multiples of 16).
@triton.jit(do_not_specialize=["num_reqs"])
def _decode_split_kernel(
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
    cos_sin_ptr: tl.tensor,
    k_new_ptr: tl.tensor,
    v_new_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_csr: tl.tensor,
    stride_knt: tl.tensor,
    stride_vnt: tl.tensor,
    q_norm_ptr: tl.tensor,
    k_norm_ptr: tl.tensor,
    norm_eps: tl.tensor,
    tickets_ptr: tl.tensor,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROTARY: tl.constexpr = False,
    PDL: tl.constexpr = False,
    SINKS: tl.constexpr = False,
    QK_NORM: tl.constexpr = False,
    COMBINE_LAST: tl.constexpr = False,
    SPLITS_PAD: tl.constexpr = 1,
) -> None:
    """Grid ``(num_tokens, num_kv_heads, NUM_SPLITS)``: token ``t``'s GROUP
    query heads of one KV head against key segment ``split`` of the keys it
    sees (requests of any query length: a decode batch, a verify step's
    ``1 + k`` tokens a request; each token's programs read the keys of its
    own causal range). NUM_SPLITS > 1:
    the normalised fp32 output and the log2-sum-exp go to ``part[t, head,
    split]`` / ``lse[t, head, split]`` (an empty segment writes lse -inf only,
    padding rows nothing); NUM_SPLITS == 1: the output goes to ``out``,
    padding rows zeros.

    ROTARY (the fused decode; one query token a request only: a token's key
    must be read by its own programs alone): q and the token's own key come in unrotated
    (``k_new`` / ``v_new`` rows, not yet in the cache): each program rotates
    its q rows as it loads them (neox style, cos/sin of the token's position,
    its key's index ``keys_end - 1``, in float32, rounded to q's dtype as
    ``rotary_and_store_kv`` stores them), and the program of the last
    segment, the only one that reads the new key, rotates it and stores it
    and its value to the token's slot (none for slot < 0) before its loop,
    behind a barrier. PDL: launched with programmatic dependent launch
    (:mod:`asyncstep.ops.triton.pdl`). SINKS: segment 0's softmax starts
    from each head's sink (so does the whole row's: its log-sum-exp
    carries it into the combine). QK_NORM (with ROTARY): q and the new key
    come un-normed too: each head is RMSNormed (weights ``q_norm`` /
    ``k_norm``, ``norm_eps``) and rounded to q's dtype before its rotation,
    as :func:`~asyncstep.ops.triton.fused.qk_rms_norm` rounds it.

    COMBINE_LAST (NUM_SPLITS > 1; the launcher always sets it): each
    program takes a ticket (``tickets[t, kv_head]``, int32, zero before the
    launch) once its segment is stored, and the last of a token's segments
    to arrive combines them into ``out`` (:func:`_combine_segments`; padding
    rows: zeros) and sets the ticket back to zero."""
    # With PDL the next kernel may launch now; this one reads the step's
    # metadata (written before the step's first kernel: pdl.py), then waits
    # for the kernel before (q is its output) before it reads anything else.
    launch_dependents(PDL)
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows % GROUP
    tokens = tl.zeros_like(rows) + token
    active = token < tl.load(qsl_ptr + num_reqs)
    keys_end = token * 0
    seg_start = keys_end
    seg_end = keys_end
    req = keys_end
    if active:
        req, keys_end = _decode_token(qsl_ptr, seq_lens_ptr, num_reqs, token)
        seg_len = _segment_len(keys_end, NUM_SPLITS, TILE_N)
        seg_start = split * seg_len
        seg_end = tl.minimum(seg_start + seg_len, keys_end)
    wait_prior(PDL)  # q and the cache's new key are the kernel before's
    if active:
        if seg_start < seg_end:
            dims = tl.arange(0, HEAD_DIM_PAD)
            q_row = q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
            q_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
            q = tl.load(q_row + dims[None, :] * stride_qd, mask=q_mask, other=0.0)
            bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_btr
            k_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_ch
            v_head_ptr = k_head_ptr + stride_c
            if ROTARY:
                HALF: tl.constexpr = HEAD_DIM // 2
                dim_mask = dims < HEAD_DIM
                # x1 * cos - x2 * sin in the first half, x2 * cos + x1 * sin in the second.
                partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
                sign = tl.where(dims < HALF, -1.0, 1.0)
                # A decode token's position is its key's index (no load to wait for).
                cs_row = cos_sin_ptr + (keys_end - 1).to(tl.int64) * stride_csr
                cos = tl.load(cs_row + dims % HALF, mask=dim_mask, other=0.0)
                sin = tl.load(cs_row + HALF + dims % HALF, mask=dim_mask, other=0.0) * sign
                q_partner = tl.load(q_row + partner[None, :] * stride_qd, mask=q_mask, other=0.0)
                if QK_NORM:
                    q, q_partner = _norm_head_rows(
                        q, q_partner, q_norm_ptr, dims, partner, dim_mask, norm_eps, HEAD_DIM
                    )
                q = (q.to(tl.float32) * cos[None, :] + q_partner.to(tl.float32) * sin[None, :]).to(
                    q_ptr.dtype.element_ty
                )
                if seg_end == keys_end:  # the segment of the new key
                    slot = tl.load(slot_ptr + token).to(tl.int64)
                    if slot >= 0:
                        k_row = k_new_ptr + token.to(tl.int64) * stride_knt + kv_head * HEAD_DIM
                        k_new = tl.load(k_row + dims, mask=dim_mask, other=0.0)
                        k_partner = tl.load(k_row + partner, mask=dim_mask, other=0.0)
                        if QK_NORM:
                            k_new, k_partner = _norm_head_rows(
                                k_new[None, :],
                                k_partner[None, :],
                                k_norm_ptr,
                                dims,
                                partner,
                                dim_mask,
                                norm_eps,
                                HEAD_DIM,
                            )
                            k_new, k_partner = (
                                tl.reshape(k_new, [HEAD_DIM_PAD]),
                                tl.reshape(k_partner, [HEAD_DIM_PAD]),
                            )
                        k_new = k_new.to(tl.float32) * cos + k_partner.to(tl.float32) * sin
                        v_row = v_new_ptr + token.to(tl.int64) * stride_vnt + kv_head * HEAD_DIM
                        v_new = tl.load(v_row + dims, mask=dim_mask, other=0.0)
                        dst = (
                            k_head_ptr
                            + (slot // BLOCK_SIZE) * stride_cb
                            + (slot % BLOCK_SIZE) * stride_cs
                            + dims * stride_cd
                        )
                        tl.store(dst, k_new.to(kv_ptr.dtype.element_ty), mask=dim_mask)
                        tl.store(dst + stride_c, v_new, mask=dim_mask)
                    # The loop below reads the new key back: the stores first.
                    tl.debug_barrier()
            full_end = seg_start + (seg_end - seg_start) // TILE_N * TILE_N
            m_i, l_i = _softmax_start(sinks_ptr, heads, SINKS, BLOCK_M)
            if SINKS:  # the sink is segment 0's
                m_i = tl.where(split == 0, m_i, -1.0e30)
                l_i = tl.where(split == 0, l_i, 0.0)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
            for start in range(seg_start, full_end, TILE_N):
                m_i, l_i, acc = _decode_keys(
                    q,
                    m_i,
                    l_i,
                    acc,
                    bt_row_ptr,
                    stride_btb,
                    k_head_ptr,
                    v_head_ptr,
                    stride_cb,
                    stride_cs,
                    stride_cd,
                    start,
                    seg_end,
                    scale_log2,
                    False,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                    BLOCK_SIZE,
                    TILE_N,
                    DOT_PRECISION,
                )
            for start in range(full_end, seg_end, TILE_N):  # at most one partial tile
                m_i, l_i, acc = _decode_keys(
                    q,
                    m_i,
                    l_i,
                    acc,
                    bt_row_ptr,
                    stride_btb,
                    k_head_ptr,
                    v_head_ptr,
                    stride_cb,
                    stride_cs,
                    stride_cd,
                    start,
                    seg_end,
                    scale_log2,
                    True,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                    BLOCK_SIZE,
                    TILE_N,
                    DOT_PRECISION,
                )
            # A non-empty segment has l_i >= 1 on every row (its maximum adds 1).
            acc = acc / l_i[:, None]
            if NUM_SPLITS == 1:
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
            else:
                _store_rows(
                    part_ptr + split.to(tl.int64) * stride_ps,
                    acc,
                    tokens,
                    heads,
                    row_mask,
                    stride_pt,
                    stride_ph,
                    stride_pd,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                )
                lse_ptrs = lse_ptr + token.to(tl.int64) * stride_lt + heads * stride_lh + split
                tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=row_mask)
        elif NUM_SPLITS == 1:  # no visible key (not a valid input): zeros, not garbage
            zeros = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
            _store_rows(
                out_ptr,
                zeros,
                tokens,
                heads,
                row_mask,
                stride_ot,
                stride_oh,
                stride_od,
                HEAD_DIM,
                HEAD_DIM_PAD,
            )
        else:  # an empty segment: weight exp2(-inf) = 0, its partial output unread
            lse_ptrs = lse_ptr + token.to(tl.int64) * stride_lt + heads * stride_lh + split
            tl.store(lse_ptrs, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_mask)
    elif NUM_SPLITS == 1:  # a padding row (the last segment's combine zeros them otherwise)
        zeros = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        _store_rows(
            out_ptr,
            zeros,
            tokens,
            heads,
            row_mask,
            stride_ot,
            stride_oh,
            stride_od,
            HEAD_DIM,
            HEAD_DIM_PAD,
        )

    if COMBINE_LAST:
        tl.debug_barrier()  # every thread's part and lse stored before the ticket
        ticket = tickets_ptr + token.to(tl.int64) * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:  # the token's other segments are stored
            _combine_segments(
                out_ptr,
                part_ptr,
                lse_ptr,
                token,
                tokens,
                heads,
                row_mask,
                active,
                stride_ot,
                stride_oh,
                stride_od,
                stride_pt,
                stride_ph,
                stride_ps,
                stride_pd,
                stride_lt,
                stride_lh,
                HEAD_DIM,
                HEAD_DIM_PAD,
                NUM_SPLITS,
                SPLITS_PAD,
                BLOCK_M,
            )
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # for the next launch


@triton.jit
def _combine_segments(
    out_ptr: tl.tensor,
    part_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    token: tl.tensor,
    tokens: tl.tensor,
    heads: tl.tensor,
    row_mask: tl.tensor,
    active: tl.tensor,
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
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
) -> None:
    """``out`` rows ``heads`` of ``token`` from its segments' parts, each
    weighted by ``exp2(lse)`` (empty segments, lse -inf, not read), summed
    segment by segment; zeros where not ``active`` (a padding row) or every
    segment is empty. The parts are read past the cache (``.cg``): other
    programs wrote them."""
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse_rows = lse_ptr + token.to(tl.int64) * stride_lt + heads[:, None] * stride_lh
    seen = row_mask[:, None] & (splits < NUM_SPLITS)[None, :]
    lse = tl.load(lse_rows + splits[None, :], mask=seen, other=float("-inf"), cache_modifier=".cg")
    lse = tl.where(active, lse, float("-inf"))  # a padding row: its programs wrote nothing
    lse_max = tl.max(lse, 1)
    shift = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    weight = tl.where(lse > float("-inf"), tl.exp2(lse - shift[:, None]), 0.0)
    total = tl.sum(weight, 1)
    part_rows = (
        part_ptr
        + token.to(tl.int64) * stride_pt
        + heads[:, None] * stride_ph
        + dims[None, :] * stride_pd
    )
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for split in range(NUM_SPLITS):
        w = tl.sum(tl.where(splits[None, :] == split, weight, 0.0), 1)
        part_mask = (w > 0.0)[:, None] & (dims < HEAD_DIM)[None, :]
        part_ptrs = part_rows + split * stride_ps
        part = tl.load(part_ptrs, mask=part_mask, other=0.0, cache_modifier=".cg")
        acc += part * w[:, None]
    acc = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    _store_rows(
        out_ptr, acc, tokens, heads, row_mask, stride_ot, stride_oh, stride_od, HEAD_DIM,
        HEAD_DIM_PAD,
    )  # fmt: skip
