"""The Triton kernels behind :mod:`asyncstep.ops.triton.attention` (which
launches them): the KV-cache store, the paged-attention tile kernel and the
split-KV decode kernels with their combine step.

May import triton only.

The KV cache of one layer is ``[2, num_kv_heads, num_blocks, block_size,
head_dim]`` (0: keys, 1: values; one KV head's block is a contiguous
``[block_size, head_dim]`` tile); token slot = ``block_id * block_size +
offset``. Both functions are CUDA-graph safe: the launch grid and every
host-side choice depend only on tensor shapes, never on their values, so a
captured call replays correctly with new ``query_start_loc``, ``seq_lens``,
``block_table`` and ``slot_mapping`` values.

How :func:`paged_attention` splits the work, when some request has several
query tokens (``num_tokens != num_reqs``): a program attends one *query
tile* (``BLOCK_Q`` consecutive query tokens of one request, times the
``group`` query heads sharing one KV head: ``BLOCK_M`` rows) against that
request's keys, ``TILE_N`` keys at a time, with an online softmax in fp32.
Request ``r``'s query tiles are numbered from ``qsl[r] // BLOCK_Q + r`` (an
upper bound of the tiles before it, so no prefix sum is needed); tile numbers
past a request's last tile are empty programs that exit at once. The grid
``num_tokens // BLOCK_Q + num_reqs + 1`` bounds the tile numbers of every
possible batch of that shape; the programs numbered past the last request
write zeros into the padding rows (``qsl[num_reqs]:``). A program finds its
request by a binary search over those tile numbers.

When the shape says every request may be a decode (``num_tokens ==
num_reqs``), the keys are split too ("flash decoding"): the grid is
``(num_tokens, num_kv_heads, NUM_SPLITS)``, a program attends one query token
(times the group's heads, which share each K/V load) against one *segment* of
its keys: ``cdiv(keys, NUM_SPLITS)`` rounded up to ``TILE_N``, computed in the
kernel from the loaded ``seq_lens`` (segments past the last key are empty
programs). NUM_SPLITS comes from the shape only (enough programs to fill the
GPU ``DECODE_PROGRAMS_PER_SM`` times over, at most ``MAX_DECODE_SPLITS``): a graph captured
with it replays right for any lengths. Each program writes its normalised
fp32 partial output and log-sum-exp to scratch and takes a ticket; the last
of a token's programs (for its KV head) to arrive combines the non-empty
segments into ``out`` (padding rows: zeros). With ``NUM_SPLITS == 1`` a
program writes ``out`` itself. A request of several tokens in such a batch is still right
(a program per token).

A sliding window (``WINDOW > 0``, a constexpr: a kernel per window) is the
tile kernel's alone (the launcher sends every windowed batch there): a
query tile reads keys from the ``TILE_N`` tile its first query's window
starts in, every key tile masked (causal, and ``key > q_pos - WINDOW``).
Sinks (``SINKS``): a row's online softmax starts from its head's sink (max
``sink * log2(e)``, sum 1); in the split-KV kernel segment 0's alone (its
log-sum-exp carries the sink to the combine, which is unchanged).
"""

from __future__ import annotations

import triton
import triton.language as tl

# --------------------------------------------------------------------------
# store_kv_cache


@triton.jit
def _store_kv_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_kd: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_vd: tl.tensor,
    stride_c: tl.tensor,
    stride_ch: tl.tensor,
    stride_cb: tl.tensor,
    stride_cs: tl.tensor,
    stride_cd: tl.tensor,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
) -> None:
    """One program per token: copies all its KV heads' key and value rows to its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, HEADS_PAD).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM_PAD).to(tl.int64)
        mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = (
            block * stride_cb
            + offset * stride_cs
            + heads[:, None] * stride_ch
            + dims[None, :] * stride_cd
        )
        k_src = token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd
        v_src = token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd
        tl.store(kv_ptr + dst, tl.load(key_ptr + k_src, mask=mask), mask=mask)
        tl.store(kv_ptr + stride_c + dst, tl.load(value_ptr + v_src, mask=mask), mask=mask)


# --------------------------------------------------------------------------
# paged_attention: device helpers


@triton.jit
def _tile_start(qsl_ptr: tl.tensor, req: tl.tensor, BLOCK_Q: tl.constexpr) -> tl.tensor:
    """The first tile number of request ``req`` (also valid for ``req == num_reqs``)."""
    start = tl.load(qsl_ptr + req)
    if BLOCK_Q == 1:
        return start
    else:
        return start // BLOCK_Q + req


@triton.jit
def _find_request(
    qsl_ptr: tl.tensor,
    num_reqs: tl.tensor,
    tile: tl.tensor,
    BLOCK_Q: tl.constexpr,
) -> tl.tensor:
    """The last request whose first tile number is <= ``tile`` (binary search).

    Requires ``tile < _tile_start(num_reqs)``. Padded requests (empty query
    ranges) share their first tile number with the next request when
    ``BLOCK_Q == 1``; the last one wins, which is the one owning the tile.
    """
    lo = tl.zeros_like(tile)  # a tensor, not a constant: lo/hi are loop-carried
    hi = lo + num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = _tile_start(qsl_ptr, mid, BLOCK_Q) <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _store_rows(
    out_ptr: tl.tensor,
    tile: tl.tensor,
    tokens: tl.tensor,
    heads: tl.tensor,
    row_mask: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_od: tl.tensor,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
) -> None:
    """Store a ``[BLOCK_M, HEAD_DIM_PAD]`` tile: row m to ``out[tokens[m], heads[m], :]``."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    ptrs = (
        out_ptr
        + tokens.to(tl.int64)[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + dims[None, :] * stride_od
    )
    tl.store(ptrs, tile.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (dims < HEAD_DIM))


@triton.jit
def _softmax_start(
    sinks_ptr: tl.tensor, heads: tl.tensor, SINKS: tl.constexpr, BLOCK_M: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """A row block's online-softmax state before any key: running maximum
    (log2 units) and sum. Without SINKS a finite start (a row whose first
    tile is all masked gets p = 0, not NaN) and sum 0; with them the row's
    head's sink as the first logit (``sink * log2(e)``, sum 1; a sink of
    -inf starts from the finite start, its weight 1 gone at the first key)."""
    if SINKS:
        sink = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634
        m_i = tl.maximum(sink, -1.0e30)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i


@triton.jit
def _load_kv_tile(
    bt_row_ptr: tl.tensor,
    stride_btb: tl.tensor,
    k_head_ptr: tl.tensor,
    stride_cb: tl.tensor,
    stride_cs: tl.tensor,
    stride_cd: tl.tensor,
    start: tl.tensor,
    keys_end: tl.tensor,
    TRANSPOSED: tl.constexpr,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
) -> tl.tensor:
    """Keys ``start .. start + TILE_N`` of one request and KV head, read through
    the block table: ``[HEAD_DIM_PAD, TILE_N]`` when TRANSPOSED, else
    ``[TILE_N, HEAD_DIM_PAD]``. Keys at or past ``keys_end`` (when MASKED) and
    dims past HEAD_DIM read as zero."""
    keys = start + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    if MASKED:
        key_mask = keys < keys_end
        blocks = tl.load(bt_row_ptr + (keys // BLOCK_SIZE) * stride_btb, mask=key_mask, other=0)
    else:
        key_mask = keys >= 0  # all true; HEAD_DIM padding may still need a mask
        blocks = tl.load(bt_row_ptr + (keys // BLOCK_SIZE) * stride_btb)
    rows = blocks.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE).to(tl.int64) * stride_cs
    if TRANSPOSED:
        ptrs = k_head_ptr + rows[None, :] + dims[:, None] * stride_cd
        mask = key_mask[None, :] & (dims < HEAD_DIM)[:, None]
    else:
        ptrs = k_head_ptr + rows[:, None] + dims[None, :] * stride_cd
        mask = key_mask[:, None] & (dims < HEAD_DIM)[None, :]
    if MASKED or HEAD_DIM != HEAD_DIM_PAD:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_keys(
    q: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    q_pos: tl.tensor,
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
    WINDOW: tl.constexpr = 0,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One online-softmax step over keys ``start .. start + TILE_N``.

    ``m_i``/``l_i`` are the running row maxima (log2 units) and sums, ``acc``
    the unnormalised output. When MASKED, key j is visible to row m only if
    ``j <= q_pos[m]`` (causal) and ``j < keys_end``, and with a WINDOW (> 0)
    ``j > q_pos[m] - WINDOW``."""
    k = _load_kv_tile(
        bt_row_ptr,
        stride_btb,
        k_head_ptr,
        stride_cb,
        stride_cs,
        stride_cd,
        start,
        keys_end,
        True,
        MASKED,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_SIZE,
        TILE_N,
    )
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        keys = start + tl.arange(0, TILE_N)
        visible = (keys[None, :] <= q_pos[:, None]) & (keys < keys_end)[None, :]
        if WINDOW > 0:
            visible = visible & (keys[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_tile(
        bt_row_ptr,
        stride_btb,
        v_head_ptr,
        stride_cb,
        stride_cs,
        stride_cd,
        start,
        keys_end,
        False,
        MASKED,
        HEAD_DIM,
        HEAD_DIM_PAD,
        BLOCK_SIZE,
        TILE_N,
    )
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    out_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
    seq_lens_ptr: tl.tensor,
    bt_ptr: tl.tensor,
    scale_log2: tl.tensor,
    sinks_ptr: tl.tensor,
    tile: tl.tensor,
    kv_head: tl.tensor,
    num_reqs: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_qd: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_od: tl.tensor,
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
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
) -> None:
    """Attention of one query tile (a request's queries ``first .. first +
    BLOCK_Q`` times the GROUP heads of ``kv_head``); nothing if the tile is empty.
    With a WINDOW (> 0): every key tile masked, from the tile the first
    query's window starts in (no block before it is read)."""
    req = _find_request(qsl_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    first = (tile - _tile_start(qsl_ptr, req, BLOCK_Q)) * BLOCK_Q
    if first < q_len:
        rows = tl.arange(0, BLOCK_M)
        in_tile = rows // GROUP  # the row's query token within the tile
        heads = kv_head * GROUP + rows % GROUP
        # Queries are the last q_len positions of the sequence.
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

        # Keys every row sees (no causal mask), then the rest up to the tile's last query.
        first_pos = seq_len - q_len + first
        unmasked_end = (first_pos + 1) // TILE_N * TILE_N
        keys_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
        bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_btr
        k_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_ch
        v_head_ptr = k_head_ptr + stride_c
        m_i, l_i = _softmax_start(sinks_ptr, heads, SINKS, BLOCK_M)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        if WINDOW > 0:
            lo = tl.maximum(first_pos - WINDOW + 1, 0) // TILE_N * TILE_N
            for start in range(lo, keys_end, TILE_N):
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
                    keys_end,
                    scale_log2,
                    True,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                    BLOCK_SIZE,
                    TILE_N,
                    DOT_PRECISION,
                    WINDOW,
                )
        else:
            for start in range(0, unmasked_end, TILE_N):
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
                    keys_end,
                    scale_log2,
                    False,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                    BLOCK_SIZE,
                    TILE_N,
                    DOT_PRECISION,
                )
            for start in range(unmasked_end, keys_end, TILE_N):
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
                    keys_end,
                    scale_log2,
                    True,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                    BLOCK_SIZE,
                    TILE_N,
                    DOT_PRECISION,
                )
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
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


# num_tokens/num_reqs change every step: no variant per value (1, multiples of 16).
@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _paged_attention_kernel(
    q_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    out_ptr: tl.tensor,
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
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
    SINKS: tl.constexpr = False,
) -> None:
    """Grid ``(tiles, num_kv_heads)``: tile numbers below the last request's
    end attend a query tile, those past it zero padding rows."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    tiles_used = _tile_start(qsl_ptr, num_reqs, BLOCK_Q)
    if tile < tiles_used:
        _attend_tile(
            q_ptr,
            kv_ptr,
            out_ptr,
            qsl_ptr,
            seq_lens_ptr,
            bt_ptr,
            scale_log2,
            sinks_ptr,
            tile,
            kv_head,
            num_reqs,
            stride_qt,
            stride_qh,
            stride_qd,
            stride_ot,
            stride_oh,
            stride_od,
            stride_c,
            stride_ch,
            stride_cb,
            stride_cs,
            stride_cd,
            stride_btr,
            stride_btb,
            HEAD_DIM,
            HEAD_DIM_PAD,
            GROUP,
            BLOCK_SIZE,
            BLOCK_Q,
            BLOCK_M,
            TILE_N,
            DOT_PRECISION,
            WINDOW,
            SINKS,
        )
    else:
        # Padding rows qsl[num_reqs]..num_tokens, BLOCK_Q tokens per spare program.
        rows = tl.arange(0, BLOCK_M)
        in_tile = rows // GROUP
        tokens = tl.load(qsl_ptr + num_reqs) + (tile - tiles_used) * BLOCK_Q + in_tile
        _store_rows(
            out_ptr,
            tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32),
            tokens,
            kv_head * GROUP + rows % GROUP,
            (in_tile < BLOCK_Q) & (tokens < num_tokens),
            stride_ot,
            stride_oh,
            stride_od,
            HEAD_DIM,
            HEAD_DIM_PAD,
        )
