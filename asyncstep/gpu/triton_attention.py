"""Triton kernels for paged attention: storing a step's keys/values into the
paged KV cache (:func:`store_kv_cache`) and attending over it
(:func:`paged_attention`), for decodes and prompt chunks in one launch.

May import torch and triton only.

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
GPU about four times over, at most ``MAX_DECODE_SPLITS``): a graph captured
with it replays right for any lengths. Each program writes its normalised
fp32 partial output and log-sum-exp to scratch; a second kernel, one program
per token and query head, combines the non-empty segments into ``out`` and
zeros the padding rows. With ``NUM_SPLITS == 1`` the first kernel writes
``out`` itself. A request of several tokens in such a batch is still right
(a program per token).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: head_dim above this is refused (the fp32 accumulator would not fit in registers).
MAX_HEAD_DIM = 256

#: log2(e): the kernel computes exp(x) as exp2(x * log2(e)).
_LOG2E = 1.4426950408889634

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Decode batches split the keys until the grid has this many programs per SM...
DECODE_PROGRAMS_PER_SM = 4
#: ...with at most this many segments per sequence.
MAX_DECODE_SPLITS = 16
#: SMs assumed off CUDA (the Triton interpreter): small test batches take a few splits.
_DEFAULT_NUM_SMS = 8


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


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's key and value into its cache slot.

    key/value ``[num_tokens, num_kv_heads, head_dim]`` (may be non-contiguous
    views with unit last stride); slot_mapping int64 ``[>= num_tokens]`` (only
    the first num_tokens entries are used); slot -1 = padding: not written.
    """
    _check_store_args(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_pad = triton.next_power_of_2(num_kv_heads)
    dim_pad = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=heads_pad,
        HEAD_DIM_PAD=dim_pad,
        BLOCK_SIZE=kv_cache.shape[3],
        num_warps=4 if heads_pad * dim_pad >= 1024 else 1,
    )


def _check_store_args(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Raise ValueError, with one line, for arguments store_kv_cache cannot take."""
    _check_rank("key", key, 3)
    _check_rank("kv_cache", kv_cache, 5)
    _check_rank("slot_mapping", slot_mapping, 1)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _check_cache(kv_cache, key.shape[1], key.shape[2])
    _check_same_dtype(kv_cache.dtype, key=key, value=value)
    _check_same_device(kv_cache.device, key=key, value=value, slot_mapping=slot_mapping)
    _check_dtype("slot_mapping", slot_mapping, torch.int64)
    if slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )


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
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One online-softmax step over keys ``start .. start + TILE_N``.

    ``m_i``/``l_i`` are the running row maxima (log2 units) and sums, ``acc``
    the unnormalised output. When MASKED, key j is visible to row m only if
    ``j <= q_pos[m]`` (causal) and ``j < keys_end``."""
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
) -> None:
    """Attention of one query tile (a request's queries ``first .. first +
    BLOCK_Q`` times the GROUP heads of ``kv_head``); nothing if the tile is empty."""
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
        # Finite start: a row whose first tile is all masked gets p = 0, not NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
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
    of keys it sees (causal: up to and including its own position)."""
    req = token
    q_start = tl.load(qsl_ptr + token)
    q_end = tl.load(qsl_ptr + token + 1)
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
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    """Grid ``(num_tokens == num_reqs, num_kv_heads, NUM_SPLITS)``: token ``t``'s GROUP
    query heads of one KV head against key segment ``split``. NUM_SPLITS > 1:
    the normalised fp32 output and the log2-sum-exp go to ``part[t, head,
    split]`` / ``lse[t, head, split]`` (an empty segment writes lse -inf only,
    padding rows nothing); NUM_SPLITS == 1: the output goes to ``out``,
    padding rows zeros."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows % GROUP
    tokens = tl.zeros_like(rows) + token
    if token < tl.load(qsl_ptr + num_reqs):
        req, keys_end = _decode_token(qsl_ptr, seq_lens_ptr, num_reqs, token)
        seg_len = _segment_len(keys_end, NUM_SPLITS, TILE_N)
        seg_start = split * seg_len
        seg_end = tl.minimum(seg_start + seg_len, keys_end)
        if seg_start < seg_end:
            dims = tl.arange(0, HEAD_DIM_PAD)
            q_ptrs = (
                q_ptr
                + token.to(tl.int64) * stride_qt
                + heads[:, None] * stride_qh
                + dims[None, :] * stride_qd
            )
            q = tl.load(q_ptrs, mask=row_mask[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
            bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_btr
            k_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_ch
            v_head_ptr = k_head_ptr + stride_c
            full_end = seg_start + (seg_end - seg_start) // TILE_N * TILE_N
            m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
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
    elif NUM_SPLITS == 1:  # a padding row (the combine kernel zeros them otherwise)
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


@triton.jit(do_not_specialize=["num_reqs"])
def _decode_combine_kernel(
    out_ptr: tl.tensor,
    part_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    qsl_ptr: tl.tensor,
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
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
) -> None:
    """Grid ``(num_tokens, num_heads)``: ``out[t, head]`` from the segments'
    partial outputs, weighted by ``exp2(lse)``; empty segments (lse -inf) are
    not read. Padding rows zeros."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    result = tl.zeros([HEAD_DIM_PAD], tl.float32)
    if token < tl.load(qsl_ptr + num_reqs):
        splits = tl.arange(0, SPLITS_PAD)
        lse_row = lse_ptr + token.to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
        lse = tl.load(lse_row + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
        used = lse > float("-inf")
        lse_max = tl.max(lse, 0)
        # All empty (no visible key, not a valid input): zeros, not NaN.
        weight = tl.where(used, tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0)), 0.0)
        part_ptrs = (
            part_ptr
            + token.to(tl.int64) * stride_pt
            + head.to(tl.int64) * stride_ph
            + splits[:, None] * stride_ps
            + dims[None, :] * stride_pd
        )
        part = tl.load(part_ptrs, mask=used[:, None] & dim_mask[None, :], other=0.0)
        total = tl.sum(weight, 0)
        result = tl.sum(part * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    out_ptrs = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=dim_mask)


# --------------------------------------------------------------------------
# paged_attention: host side


@dataclass(frozen=True)
class _AttentionLaunch:
    """Tile sizes and launch options, chosen from shapes only."""

    block_q: int  # query tokens per tile
    block_m: int  # tile rows: block_q * group, padded to a power of two >= 16
    tile_n: int  # keys per inner step
    num_warps: int
    num_stages: int

    def grid(self, num_tokens: int, num_reqs: int, num_kv_heads: int) -> tuple[int, int]:
        """Enough tile numbers for any batch of this shape, plus the spare
        programs that zero the padding rows."""
        return num_tokens // self.block_q + num_reqs + 1, num_kv_heads


def _attention_launch(group: int, head_dim_pad: int, dtype: torch.dtype) -> _AttentionLaunch:
    """Launch configuration for a batch that is not all decodes: tiles of
    about 64 rows (``64 // group`` query tokens). float32 computes its dots
    exactly, without tensor cores: smaller tiles keep them in registers."""
    wide = dtype != torch.float32
    tile_n = 64 if wide and head_dim_pad <= 128 else 32
    rows = 64 if wide else 32
    block_q = max(1, rows // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    return _AttentionLaunch(block_q, block_m, tile_n, num_warps=4 if wide else 8, num_stages=2)


@dataclass(frozen=True)
class _DecodeLaunch:
    """Decode-batch launch options, chosen from shapes (and the SM count) only."""

    block_m: int  # rows: the group's query heads, padded to a power of two >= 16
    tile_n: int  # keys per inner step; segments are multiples of it
    num_splits: int  # key segments per token (grid axis 2)
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _DEFAULT_NUM_SMS


def _decode_launch(
    num_tokens: int, num_kv_heads: int, group: int, head_dim_pad: int, dtype: torch.dtype, sms: int
) -> _DecodeLaunch:
    """Launch configuration for a decode batch (``num_tokens == num_reqs``).

    The keys are split into as many segments as it takes for the grid to hold
    ``DECODE_PROGRAMS_PER_SM`` programs per SM (1 .. ``MAX_DECODE_SPLITS``):
    small batches then still keep every SM's memory pipe busy. Never from
    seq_lens values: a captured graph replays its split count for any lengths.
    16-bit inputs read 64-key tiles (two 16 KiB tiles in flight at head_dim
    128), with three pipeline stages."""
    wide = dtype != torch.float32
    tile_n = 64 if wide and head_dim_pad <= 128 else 32
    programs = num_tokens * num_kv_heads
    target = DECODE_PROGRAMS_PER_SM * sms
    num_splits = max(1, min(MAX_DECODE_SPLITS, -(-target // max(programs, 1))))
    block_m = max(16, triton.next_power_of_2(group))
    return _DecodeLaunch(block_m, tile_n, num_splits, num_warps=4, num_stages=3 if wide else 2)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's queries over its keys in the paged cache.

    q ``[num_tokens, num_heads, head_dim]`` (may be a strided view); GQA:
    num_heads % num_kv_heads == 0. query_start_loc int32 ``[num_reqs + 1]``
    non-decreasing; request r's queries are rows ``qsl[r]:qsl[r+1]``.
    seq_lens int32 ``[num_reqs]``: tokens of request r in the cache including
    this step's (already stored) keys; its queries are the last
    ``qsl[r+1] - qsl[r]`` positions of its sequence (query i of a request
    with q_len queries and seq_len keys attends keys ``0 .. seq_len - q_len +
    i``). block_table int32 ``[num_reqs, max_blocks_per_req]`` (any strides).

    Returns out ``[num_tokens, num_heads, head_dim]`` (q's dtype); rows past
    ``qsl[num_reqs]`` (padding tokens) are zeros. Padded requests (seq_len 0,
    empty query range) produce nothing.
    """
    _check_attention_args(q, kv_cache, query_start_loc, seq_lens, block_table, out)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # fp32 stays exact (the default would be tf32); 16-bit inputs ignore it.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if num_tokens == num_reqs:
        _paged_decode(q, kv_cache, query_start_loc, seq_lens, block_table, scale, out, precision)
        return out
    launch = _attention_launch(group, head_dim_pad, q.dtype)
    _paged_attention_kernel[launch.grid(num_tokens, num_reqs, num_kv_heads)](
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        scale * _LOG2E,
        num_tokens,
        num_reqs,
        *q.stride(),
        *out.stride(),
        *kv_cache.stride(),
        *block_table.stride(),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_Q=launch.block_q,
        BLOCK_M=launch.block_m,
        TILE_N=launch.tile_n,
        DOT_PRECISION=precision,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out


def _paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    precision: str,
) -> None:
    """:func:`paged_attention` of a decode-shaped batch: the split-KV kernel,
    then (more than one split) the combine kernel. The scratch comes from the
    caching allocator (under graph capture: the graph's pool)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    launch = _decode_launch(
        num_tokens, num_kv_heads, group, head_dim_pad, q.dtype, _num_sms(q.device)
    )
    splits = launch.num_splits
    if splits > 1:
        part = torch.empty(
            (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride(), lse.stride()[:2]
    else:  # unused: the kernel writes out directly
        part, lse = out, out
        part_strides, lse_strides = (0, 0, 0, 0), (0, 0)
    _decode_split_kernel[(num_tokens, num_kv_heads, splits)](
        q,
        kv_cache,
        out,
        part,
        lse,
        query_start_loc,
        seq_lens,
        block_table,
        scale * _LOG2E,
        num_tokens,  # num_reqs
        *q.stride(),
        *out.stride(),
        *part_strides,
        *lse_strides,
        *kv_cache.stride(),
        *block_table.stride(),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=launch.block_m,
        TILE_N=launch.tile_n,
        NUM_SPLITS=splits,
        DOT_PRECISION=precision,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    if splits > 1:
        _decode_combine_kernel[(num_tokens, num_heads)](
            out,
            part,
            lse,
            query_start_loc,
            num_tokens,  # num_reqs
            *out.stride(),
            *part_strides,
            *lse_strides,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=1 if splits * head_dim_pad <= 1024 else 4,
        )


def _check_attention_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Raise ValueError, with one line, for arguments paged_attention cannot take."""
    _check_rank("q", q, 3)
    _check_rank("kv_cache", kv_cache, 5)
    _check_rank("query_start_loc", query_start_loc, 1)
    _check_rank("seq_lens", seq_lens, 1)
    _check_rank("block_table", block_table, 2)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[1]
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    _check_same_dtype(q.dtype, kv_cache=kv_cache)
    _check_same_device(
        q.device,
        kv_cache=kv_cache,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
    )
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_table", block_table),
    ):
        _check_dtype(name, t, torch.int32)
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] != num_reqs:
        raise ValueError(
            f"{num_reqs} requests (seq_lens) need query_start_loc of {num_reqs + 1} entries "
            f"and block_table of {num_reqs} rows, got {query_start_loc.shape[0]} and "
            f"{block_table.shape[0]}"
        )
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"expected {tuple(q.shape)} {q.dtype} on {q.device}"
        )


# --------------------------------------------------------------------------
# argument checks shared by both entry points


def _check_rank(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """kv_cache must be ``[2, num_kv_heads, blocks, block_size, head_dim]`` of a supported dtype."""
    if kv_cache.shape[0] != 2 or kv_cache.shape[1] != num_kv_heads or kv_cache.shape[4] != head_dim:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not "
            f"[2, {num_kv_heads}, blocks, block_size, {head_dim}]"
        )
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not in 1..{MAX_HEAD_DIM}")
    if kv_cache.dtype not in _DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not one of {_DTYPES}")


def _check_same_dtype(dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype} does not match {dtype}")


def _check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
