"""Paged attention on the GPU: :func:`store_kv_cache` writes a step's keys and
values into the paged KV cache, :func:`paged_attention` attends over it, for
decodes and prompt chunks in one launch. This module checks the arguments and
chooses the launch (from shapes only: CUDA-graph safe); the kernels, and how
they split the work, are in :mod:`asyncstep.ops.triton.attention_kernels` and
:mod:`asyncstep.ops.triton.decode_kernels`.

May import torch, triton, asyncstep.ops.triton.pdl and :mod:`asyncstep.ops.attention`
(the shapes' types).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from asyncstep.ops.attention import QkNorm
from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.attention_kernels import _paged_attention_kernel, _store_kv_kernel
from asyncstep.ops.triton.decode_kernels import _decode_split_kernel

MAX_HEAD_DIM = 256

#: log2(e): the kernel computes exp(x) as exp2(x * log2(e)).
_LOG2E = 1.4426950408889634

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Decode batches split the keys until the grid has this many programs per SM...
DECODE_PROGRAMS_PER_SM = 2
#: ...with at most this many segments per sequence.
MAX_DECODE_SPLITS = 16
#: SMs assumed off CUDA (the Triton interpreter, which runs the programs one
#: after another): a small test batch still takes a few splits (one token of
#: 2 KV heads: 4, two tokens: 2), not 16 segments mostly past its keys.
_DEFAULT_NUM_SMS = 4
#: Batches whose queries are at most this long (a speculative verify step's
#: ``1 + k`` tokens a request) take the split-KV decode kernels too: each
#: token's programs read its request's keys up to its own causal end.
MAX_SPLIT_KV_QUERY_LEN = 8
#: Tickets a buffer of :func:`decode_tickets` holds at least.
_MIN_TICKETS = 1 << 14
_tickets_held: dict[tuple[str, int, int], torch.Tensor] = {}
_tickets_kept: list[torch.Tensor] = []


# --------------------------------------------------------------------------
# store_kv_cache


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
    128), unpipelined: a segment is a few tiles, and a pipeline's prologue
    costs more than it hides (picked by measurement, as the programs per SM:
    ``benchmarks/studies/fastpath/README.md``)."""
    wide = dtype != torch.float32
    tile_n = 64 if wide and head_dim_pad <= 128 else 32
    programs = num_tokens * num_kv_heads
    target = DECODE_PROGRAMS_PER_SM * sms
    num_splits = max(1, min(MAX_DECODE_SPLITS, -(-target // max(programs, 1))))
    block_m = max(16, triton.next_power_of_2(group))
    return _DecodeLaunch(block_m, tile_n, num_splits, num_warps=4, num_stages=1 if wide else 2)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
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

    ``max_query_len``: a bound on every request's query length (None:
    unknown). A decode-shaped batch (as many tokens as requests) or one
    whose queries are at most :data:`MAX_SPLIT_KV_QUERY_LEN` long (a
    speculative verify step) runs the split-KV kernels, one program row
    block per token; other batches the query-tiled kernel. Only the shapes
    decide (a CUDA graph replays its kernels for any values).

    ``sliding_window`` ``W``: query i sees only the last ``W`` of its keys
    (``seq_len - q_len + i - W + 1 ..``); every batch then runs the
    query-tiled kernel, which reads no block before a query tile's first
    window.

    ``sinks`` ``[num_heads]`` (gpt-oss; any float dtype, on q's device):
    each head's logit that joins its rows' softmax denominator without a
    value; either kernel takes them.
    """
    _check_attention_args(q, kv_cache, query_start_loc, seq_lens, block_table, out)
    sink_logits = sink_logits_of(sinks, q)
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
    short = max_query_len is not None and max_query_len <= MAX_SPLIT_KV_QUERY_LEN
    if not sliding_window and (num_tokens == num_reqs or short):
        _paged_decode(
            q, kv_cache, query_start_loc, seq_lens, block_table, scale, out, precision,
            sinks=sink_logits,
        )  # fmt: skip
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
        q if sink_logits is None else sink_logits,
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
        WINDOW=sliding_window or 0,
        SINKS=sink_logits is not None,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out


def rotary_store_and_attend(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    uniform_decode: bool,
    max_query_len: int | None = None,
    sinks: torch.Tensor | None = None,
    qk_norm: QkNorm | None = None,
) -> torch.Tensor:
    """:func:`~asyncstep.ops.triton.rotary.rotary_and_store_kv` (q, k, v:
    ``[tokens, heads * head_dim]`` column slices, unrotated) then
    :func:`paged_attention`; returns the attention's output ``[tokens,
    num_heads, head_dim]``. A uniform decode batch (``uniform_decode``:
    every request has one query token, or none; as many tokens as requests)
    takes one kernel fewer: the split-KV kernel rotates q as it loads it
    and stores the rotated key and the value of each token (``ROTARY`` in
    :mod:`asyncstep.ops.triton.decode_kernels`: a token's own key is read by its
    own programs only); q and k are then left unrotated (other batches: the
    two calls, which rotate them in place; ``max_query_len`` as
    :func:`paged_attention` takes it). A decode token's position must
    be its key's index (``seq_len - 1``): the kernel takes it from there,
    ``positions`` only where it runs the two calls. ``sinks``: as
    :func:`paged_attention`'s. ``qk_norm``: q and k come un-normed; the
    split-KV kernel norms each head before it rotates it (the two calls:
    :func:`~asyncstep.ops.triton.fused.qk_rms_norm` first)."""
    from asyncstep.ops.triton.rotary import rotary_and_store_kv

    head_dim = kv_cache.shape[4]
    tokens = q.shape[0]
    if tokens == 0 or tokens != seq_lens.shape[0] or not uniform_decode:
        q, k = normed_qk(q, k, qk_norm)
        rotary_and_store_kv(positions, q, k, v, cos_sin_cache, head_dim, kv_cache, slot_mapping)
        return paged_attention(
            q.view(tokens, -1, head_dim),
            kv_cache,
            query_start_loc,
            seq_lens,
            block_table,
            scale,
            max_query_len=max_query_len,
            sinks=sinks,
        )
    from asyncstep.ops.triton.rotary import _check_rotary_args
    from asyncstep.ops.triton.rotary import _check_store_args as _check_kv_args

    _check_rotary_args(positions, q, k, cos_sin_cache, head_dim)
    _check_kv_args(k, v, head_dim, kv_cache, slot_mapping)
    if qk_norm is not None:
        _check_qk_norm(qk_norm, head_dim, q.device)
    q3 = q.view(tokens, -1, head_dim)
    _check_attention_args(q3, kv_cache, query_start_loc, seq_lens, block_table, None)
    out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    rotary = _DecodeRotary(cos_sin_cache, k, v, slot_mapping, qk_norm)
    _paged_decode(
        q3, kv_cache, query_start_loc, seq_lens, block_table, scale, out, precision, rotary,
        sink_logits_of(sinks, q3),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class _DecodeRotary:
    """What the split-KV kernel needs to rotate and store the new keys itself."""

    cos_sin_cache: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    qk_norm: QkNorm | None = None


def normed_qk(
    q: torch.Tensor, k: torch.Tensor, qk_norm: QkNorm | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k through ``qk_norm`` (:func:`~asyncstep.ops.triton.fused.qk_rms_norm`;
    None: as they are)."""
    if qk_norm is None:
        return q, k
    from asyncstep.ops.triton.fused import qk_rms_norm

    return qk_rms_norm(q, k, qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps)


def _check_qk_norm(qk_norm: QkNorm, head_dim: int, device: torch.device) -> None:
    for name, w in (("q_weight", qk_norm.q_weight), ("k_weight", qk_norm.k_weight)):
        if tuple(w.shape) != (head_dim,) or not w.is_floating_point() or w.stride(0) != 1:
            raise ValueError(
                f"qk_norm {name} must be a contiguous float [{head_dim}], got {w.dtype} "
                f"{tuple(w.shape)}"
            )
        if w.device != device:
            raise ValueError(f"qk_norm {name} on {w.device}, q on {device}")


def _paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    precision: str,
    rotary: _DecodeRotary | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """:func:`paged_attention` of a decode-shaped batch: the split-KV kernel
    (more than one split: its last program of each token and KV head combines
    the segments, :func:`decode_tickets`). The scratch comes from the
    caching allocator (under graph capture: the graph's pool). ``rotary``:
    q and the new keys come unrotated, the new keys not stored yet (see
    :func:`rotary_store_and_attend`). ``sinks``: checked float32 logits
    (:func:`sink_logits_of`)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    launch = _decode_launch(
        num_tokens, num_kv_heads, group, head_dim_pad, q.dtype, _num_sms(q.device)
    )
    splits = launch.num_splits
    tickets = decode_tickets(q.device, num_tokens * num_kv_heads) if splits > 1 else None
    if splits > 1:
        part = torch.empty(
            (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride(), lse.stride()[:2]
    else:  # unused: the kernel writes out directly
        part, lse = out, out
        part_strides, lse_strides = (0, 0, 0, 0), (0, 0)
    rotary_args: tuple[torch.Tensor | int, ...] = (q, q, q, q, 0, 0, 0)  # unused
    norm_args: tuple[torch.Tensor | float, ...] = (q, q, 0.0)  # unused
    if rotary is not None:
        r = rotary
        rotary_args = (r.cos_sin_cache, r.k, r.v, r.slot_mapping)
        rotary_args += (r.cos_sin_cache.stride(0), r.k.stride(0), r.v.stride(0))
        if r.qk_norm is not None:
            norm_args = (r.qk_norm.q_weight, r.qk_norm.k_weight, float(r.qk_norm.eps))
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
        q if sinks is None else sinks,
        seq_lens.shape[0],  # num_reqs
        *q.stride(),
        *out.stride(),
        *part_strides,
        *lse_strides,
        *kv_cache.stride(),
        *block_table.stride(),
        *rotary_args,
        *norm_args,
        out if tickets is None else tickets,  # (one split: unused)
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=launch.block_m,
        TILE_N=launch.tile_n,
        NUM_SPLITS=splits,
        DOT_PRECISION=precision,
        ROTARY=rotary is not None,
        SINKS=sinks is not None,
        QK_NORM=rotary is not None and rotary.qk_norm is not None,
        COMBINE_LAST=tickets is not None,
        SPLITS_PAD=triton.next_power_of_2(splits),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **pdl.launch_kwargs(q),
    )


def decode_tickets(device: torch.device, count: int) -> torch.Tensor:
    """int32 tickets, zero between launches, for ``count`` (token, KV head)
    rows of the split-KV kernel's ``COMBINE_LAST`` (its segments' combine
    in the last program to finish, no combine kernel): one buffer a device
    and stream (kernels on two streams at once never share one), grown where
    a launch needs more. Every buffer is kept for the process's life: a
    captured CUDA graph holds its address (one allocated under capture is
    zeroed by a kernel of that graph too)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index or 0, stream)
    held = _tickets_held.get(key)
    if held is None or held.numel() < count:
        held = torch.zeros(max(count, _MIN_TICKETS), dtype=torch.int32, device=device)
        _tickets_held[key] = held
        _tickets_kept.append(held)
    return held


def sink_logits_of(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` as the kernels read them: contiguous float32 ``[num_heads]``
    on q's device (the tensor itself where it is so); ValueError, in one
    line, for others."""
    if sinks is None:
        return None
    num_heads = q.shape[1]
    if sinks.shape != (num_heads,) or not sinks.is_floating_point() or sinks.device != q.device:
        raise ValueError(
            f"sinks must be {num_heads} floating-point logits on {q.device}, got "
            f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}"
        )
    return sinks.detach().to(torch.float32).contiguous()


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
