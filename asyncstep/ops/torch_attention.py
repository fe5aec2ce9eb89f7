"""Paged attention in plain torch: the reference attention op (runs on the
CPU and CUDA). It stores a step's keys and values at their slots, runs the
decodes as one batched gather per bucket of similar lengths (the step's
host-made plan, :func:`~asyncstep.ops.attention.plan_decode_buckets`), and
prompt chunks one request at a time over their cached prefix plus the new
tokens. A sliding window masks the keys before it (a windowed decode
gathers from the first block its window reaches). A layer with attention
sinks (:attr:`~asyncstep.ops.attention.AttentionShape.sinks`) attends
through explicit matmuls and a softmax over its scores and its head's sink
logit (float32 scores where q is 16-bit), as transformers' eager gpt-oss
attention. It reads host copies of the metadata: no FULL CUDA graph over
it; :func:`reference_attention` with ``planned=False`` runs without the
decode plan (every request as a query chunk), for an op that falls back
to it.

May import torch, numpy and :mod:`asyncstep.ops.attention`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from asyncstep.ops.attention import AttentionMetadata, AttentionShape, DecodeBucket

__all__ = [
    "TorchAttention",
    "reference_attention",
    "reference_attention_backends",
    "sink_attention",
    "write_kv_cache",
]


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each real token's key/value ([tokens, kv_heads, dim]) at its slot.

    Only the step's real tokens are given; padding tokens (slot -1) come after
    them in ``slot_mapping`` and are never written.
    """
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    slots = slot_mapping[: key.shape[0]]
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slots, key.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slots, value.transpose(0, 1))


def _gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, rows: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``block_ids`` (``rows`` requests' blocks, row-major):
    ``[rows, kv_heads, length, dim]``, each head's keys contiguous.

    ``index_select`` on whole blocks: on the CPU faster than the equivalent
    advanced indexing."""
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        picked = cache.index_select(1, block_ids).view(num_kv_heads, rows, -1, head_dim)
        return picked[:, :, :length].transpose(0, 1)

    return gather(kv_cache[0]), gather(kv_cache[1])


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One bucket of decodes: q [n, heads, dim] -> [n, heads, dim].

    The query heads that share a KV head ride as that head's query "length"
    (``[n, kv_heads, group, dim]``), so keys and values are never repeated."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    mask: torch.Tensor | None
    if window is not None and window < bucket.max_len:
        block_ids, length, mask = _window_decode_plan(kv_cache.shape[3], bucket, window)
    else:
        block_ids, length, mask = bucket.block_ids, bucket.max_len, bucket.mask
    k, v = _gather_kv(kv_cache, block_ids, n, length)
    grouped = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if sinks is not None:
        sink_logits = sinks.view(1, num_kv_heads, -1, 1)
        out = sink_attention(grouped, k, v, mask, scale, sink_logits)
    elif q.device.type == "cpu":
        out = _decode_attention_matmul(grouped, k, v, mask, scale)
    else:
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


def _window_decode_plan(
    block_size: int, bucket: DecodeBucket, window: int
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A windowed bucket's blocks from the first one any of its requests'
    windows reaches, the keys' length from there, and the mask of each
    request's window (keys ``len - window .. len - 1``)."""
    lens = torch.from_numpy(bucket.lens.astype(np.int64))
    first_block = max(int(bucket.lens.min()) - window, 0) // block_size
    start = first_block * block_size
    n = len(lens)
    blocks = bucket.block_ids.view(n, -1)[:, first_block:].reshape(-1)
    length = bucket.max_len - start
    pos = torch.arange(start, bucket.max_len)[None, :]
    mask = (pos < lens[:, None]) & (pos >= (lens - window)[:, None])
    return blocks, length, mask.to(bucket.block_ids.device)[:, None, None, :]


def _decode_attention_matmul(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Decode attention as two batched matmuls: on the CPU, for one-token
    queries over short keys, faster than ``scaled_dot_product_attention``
    with a mask (``docs/performance.md``)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax has one more logit per row, its head's sink,
    that takes no value: q ``[..., rows, dim]``, k and v ``[..., keys,
    dim]``, ``mask`` (True: attended) and ``sinks`` broadcastable to the
    scores ``[..., rows, keys]`` and ``[..., rows, 1]``. Scores and softmax
    in float32 at least; the output in q's dtype."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    sink = sinks.to(dtype).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs, v.to(dtype)).to(q.dtype)


def _prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    req: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's query chunk [q_len, heads, dim] over its prefix and itself
    (with a ``window``: over the keys in each query's window)."""
    q_len, seq_len = q.shape[0], int(meta.seq_lens_cpu[req])
    context = seq_len - q_len
    windowed = window is not None and window < seq_len
    if context == 0 and not windowed and sinks is None:  # the new keys are the whole sequence
        k, v, mask, causal = k_new.transpose(0, 1), v_new.transpose(0, 1), None, True
    else:
        block_size = kv_cache.shape[3]
        # Keys from the first block the first query's window reaches.
        first_block = max(context - window + 1, 0) // block_size if window is not None else 0
        start = first_block * block_size
        blocks = meta.block_table[req, first_block : -(-seq_len // block_size)].long()
        k, v = (t[0] for t in _gather_kv(kv_cache, blocks, 1, seq_len - start))
        mask = torch.ones(q_len, seq_len - start, dtype=torch.bool, device=q.device)
        mask = mask.tril(context - start)
        if window is not None:
            mask = mask.triu(context - start - window + 1)
        causal = False
    if sinks is not None:
        return _prefill_sink_attention(q, k, v, mask, scale, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [heads, q_len, dim]
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _prefill_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """:func:`sink_attention` of a query chunk q ``[q_len, heads, dim]``
    over k, v ``[kv_heads, keys, dim]`` and ``mask`` ``[q_len, keys]``: the
    query heads sharing a KV head ride as its rows (no repeated keys)."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, group = k.shape[0], num_heads // k.shape[0]
    rows = q.permute(1, 0, 2).reshape(num_kv_heads, group * q_len, head_dim)
    sink_rows = sinks.view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
    sink_rows = sink_rows.reshape(num_kv_heads, group * q_len, 1)
    row_mask = None if mask is None else mask.repeat(group, 1)
    out = sink_attention(rows, k, v, row_mask, scale, sink_rows)
    return out.view(num_heads, q_len, head_dim).transpose(0, 1)


def reference_attention_backends() -> AbstractContextManager[None]:
    """The SDPA backends the reference path may use (enter once per forward:
    the context manager itself costs host time). Not cuDNN: it builds an
    execution plan for every new shape, and decode shapes change every step
    (the keys grow by one), so every layer of every step would pay a plan's
    host time (``benchmarks/studies/overlap/README.md``)."""
    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    *,
    planned: bool = True,
) -> torch.Tensor:
    """Paged attention in plain torch. q [tokens, heads, dim], k/v [tokens, kv_heads, dim]
    (already written to the cache). Returns [tokens, heads, dim]. ``window``
    and ``sinks``: :class:`~asyncstep.ops.attention.AttentionShape`'s.
    ``planned``: the decodes through ``meta.decode_buckets`` (else every
    request as a query chunk: a step without the plan).

    Run the forward inside :func:`reference_attention_backends`."""
    out = torch.empty_like(q)
    for bucket in meta.decode_buckets if planned else ():
        decoded = _decode_attention(
            q.index_select(0, bucket.rows), kv_cache, bucket, scale, window, sinks
        )
        out.index_copy_(0, bucket.rows, decoded)
    qsl = meta.query_start_loc_cpu
    for req in range(meta.num_decodes if planned else 0, meta.num_reqs):
        s, e = int(qsl[req]), int(qsl[req + 1])
        out[s:e] = _prefill_attention(
            q[s:e], k[s:e], v[s:e], kv_cache, meta, req, scale, window, sinks
        )
    return out


class TorchAttention:
    """The reference attention op: q and k come in rotated; rows past
    ``meta.num_actual_tokens`` (padding) are neither stored nor attended,
    and their output rows are zeros. Run the forward inside
    :func:`reference_attention_backends`."""

    name = "torch"
    #: q and k come in rotated (the op set's rotary ran first).
    rotates = False
    #: The step's decodes need the host's plan (``decode_buckets``).
    plans_decodes = True
    supports_sliding_window = True
    supports_sinks = True
    norms_qk = False

    @classmethod
    def chosen(cls, *, fused_kernels: bool, fused_decode: bool) -> TorchAttention:
        """The shared reference (it has no options)."""
        return TORCH_ATTENTION

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        shape: AttentionShape,
        cos_sin_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        n, num_padding = meta.num_actual_tokens, q.shape[0] - meta.num_actual_tokens
        q = q[:n].view(n, shape.num_heads, shape.head_dim)
        k = k[:n].view(n, shape.num_kv_heads, shape.head_dim)
        v = v[:n].view(n, shape.num_kv_heads, shape.head_dim)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = reference_attention(
            q, k, v, kv_cache, meta, shape.scale, shape.sliding_window, shape.sinks
        )
        out = out.reshape(n, shape.num_heads * shape.head_dim)
        return F.pad(out, (0, 0, 0, num_padding)) if num_padding else out


#: The reference attention op, shared (it holds nothing).
TORCH_ATTENTION = TorchAttention()
