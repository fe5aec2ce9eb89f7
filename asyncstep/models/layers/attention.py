"""Attention over a paged KV cache: the metadata a step's attention needs,
the reference backend in plain torch (runs on CPU and CUDA), and the
dispatch to the CPU kernel (``cpu_attention``) and the Triton kernels.

The KV cache of one layer is ``[2, num_kv_heads, num_blocks, block_size,
head_dim]`` (head-major: one KV head's block is a contiguous ``[block_size,
head_dim]`` tile). Token ``t`` of a step writes its key and value at
``slot_mapping[t] = block_id * block_size + offset`` (-1 for a padding token,
which writes nothing). Requests are ordered decodes first (query length 1).
The reference runs the decodes as one batched gather per bucket of similar
lengths, prompt chunks one request at a time over their cached prefix plus
the new tokens; the CPU kernel runs the whole step in one call per layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from asyncstep.models.layers.rotary import RotaryEmbedding
from asyncstep.ops.cpu.attention import CpuStepArgs
from asyncstep.ops.cpu.library import load_cpu_kernels

#: KV cache dimension of ``[2, kv_heads, blocks, block_size, head_dim]`` holding blocks.
BLOCK_DIM = 2


@dataclass
class DecodeBucket:
    """Decode requests of similar length, attended in one batch."""

    rows: torch.Tensor  # [n] int64: request (= token) rows of the bucket
    block_ids: torch.Tensor  # [n * num_blocks] int64, row-major
    max_len: int
    #: [n, 1, 1, max_len] keys past a request's end masked; None when all are max_len long.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Where each request's queries and keys are, for one step."""

    num_actual_tokens: int
    #: The first ``num_decodes`` requests have exactly one query token.
    num_decodes: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device: tokens in the cache after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: np.ndarray  # host copies: the reference loops without a device sync
    seq_lens_cpu: np.ndarray
    #: The reference backend's plan for the decodes, made once per step.
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    #: Token positions (device): for a rotary fused into the KV store.
    positions: torch.Tensor | None = None
    #: The CPU kernel's view of this metadata, made by the step's first layer.
    cpu_args: CpuStepArgs | None = field(default=None, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    def cpu_step_args(self) -> CpuStepArgs:
        """The metadata as the CPU kernel reads it (made once per step)."""
        if self.cpu_args is None:
            self.cpu_args = CpuStepArgs.build(
                self.num_actual_tokens,
                self.query_start_loc,
                self.seq_lens,
                self.block_table,
                self.slot_mapping,
                self.positions,
            )
        return self.cpu_args


def plan_decode_buckets(
    seq_lens: np.ndarray,
    block_table: torch.Tensor,
    block_size: int,
    max_buckets: int = 4,
    min_bucket: int = 4,
    to_device: Callable[[str, np.ndarray], torch.Tensor] | None = None,
) -> list[DecodeBucket]:
    """Split decode requests (lengths ``seq_lens``) into buckets of similar
    length, so a short request is not padded to the longest: sorted by
    length, cut where that saves the most padding, while buckets hold at
    least ``min_bucket`` requests. ``to_device(name, array)`` moves host
    arrays to the device (default: a plain copy)."""
    if len(seq_lens) == 0:
        return []
    order = np.argsort(seq_lens, kind="stable")
    cuts = _cuts(seq_lens[order], max_buckets, min_bucket)
    device = block_table.device
    if to_device is None:

        def to_device(name: str, array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    buckets = []
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        rows = order[lo:hi]
        lens = seq_lens[rows]
        max_len = int(lens.max())
        rows_t = to_device(f"bucket{i}_rows", rows.astype(np.int64))
        blocks = block_table.index_select(0, rows_t)[:, : -(-max_len // block_size)]
        mask = None
        if int(lens.min()) != max_len:
            valid = np.arange(max_len)[None, :] < lens[:, None]
            mask = to_device(f"bucket{i}_mask", valid)[:, None, None, :]
        buckets.append(DecodeBucket(rows_t, blocks.reshape(-1).long(), max_len, mask))
    return buckets


def _cuts(sorted_lens: np.ndarray, max_buckets: int, min_bucket: int) -> list[int]:
    """Greedy cut points [0, ..., n] of sorted lengths into at most ``max_buckets``
    (on Python ints: a numpy scalar costs more than the loop's arithmetic)."""
    n = len(sorted_lens)
    lens: list[int] = sorted_lens.tolist()
    cuts = [0, n]
    while len(cuts) - 1 < max_buckets:
        best, best_gain = None, 0
        for lo, hi in itertools.pairwise(cuts):
            top = lens[hi - 1] if hi else 0
            for c in range(lo + min_bucket, hi - min_bucket + 1):
                # Cutting at c: rows lo..c-1 pad to lens[c-1] instead of lens[hi-1].
                gain = (c - lo) * (top - lens[c - 1])
                if gain > best_gain:
                    best, best_gain = c, gain
        if best is None:
            return cuts
        cuts = sorted([*cuts, best])
    return cuts


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
    q: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, scale: float
) -> torch.Tensor:
    """One bucket of decodes: q [n, heads, dim] -> [n, heads, dim].

    The query heads that share a KV head ride as that head's query "length"
    (``[n, kv_heads, group, dim]``), so keys and values are never repeated."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    k, v = _gather_kv(kv_cache, bucket.block_ids, n, bucket.max_len)
    grouped = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if q.device.type == "cpu":
        out = _decode_attention_matmul(grouped, k, v, bucket.mask, scale)
    else:
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=bucket.mask, scale=scale)
    return out.reshape(n, num_heads, head_dim)


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


def _prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    req: int,
    scale: float,
) -> torch.Tensor:
    """One request's query chunk [q_len, heads, dim] over its prefix and itself."""
    q_len, seq_len = q.shape[0], int(meta.seq_lens_cpu[req])
    if seq_len == q_len:  # no cached prefix: the new keys are the whole sequence
        k, v, mask, causal = k_new.transpose(0, 1), v_new.transpose(0, 1), None, True
    else:
        block_size = kv_cache.shape[3]
        blocks = meta.block_table[req, : -(-seq_len // block_size)].long()
        k, v = (t[0] for t in _gather_kv(kv_cache, blocks, 1, seq_len))
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
        causal = False
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
) -> torch.Tensor:
    """Paged attention in plain torch. q [tokens, heads, dim], k/v [tokens, kv_heads, dim]
    (already written to the cache). Returns [tokens, heads, dim].

    Run the forward inside :func:`reference_attention_backends`."""
    out = torch.empty_like(q)
    for bucket in meta.decode_buckets:
        out.index_copy_(
            0,
            bucket.rows,
            _decode_attention(q.index_select(0, bucket.rows), kv_cache, bucket, scale),
        )
    qsl = meta.query_start_loc_cpu
    for req in range(meta.num_decodes, meta.num_reqs):
        s, e = int(qsl[req]), int(qsl[req + 1])
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], kv_cache, meta, req, scale)
    return out


class Attention(nn.Module):
    """Writes this layer's keys/values into its paged cache, then attends.

    The runner binds ``kv_cache`` once the cache is allocated. Rows past
    ``meta.num_actual_tokens`` are padding (sequence parallelism pads a step to
    a multiple of tp_size): they are neither written nor attended, and their
    output rows are zeros.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache = torch.empty(0)
        #: "torch" (the reference: host-planned, dynamic shapes), "cpu" (the
        #: CPU kernel: one call per layer) or "triton" (paged kernels reading
        #: only device metadata: CUDA-graph safe).
        self.backend = "torch"
        #: With the Triton or CPU backend, the rotary embedding to apply to q
        #: and k in the kernel (then q and k come in unrotated); None: the
        #: caller rotated them.
        self.fused_rotary: RotaryEmbedding | None = None
        #: With the Triton backend and a fused rotary: decode batches rotate and
        #: store the new keys inside the attention's split-KV kernel (set by
        #: the runner with ``fused_decode``).
        self.fused_decode = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.backend == "triton":
            return self._forward_triton(q, k, v, meta)
        if self.backend == "cpu":
            return self._forward_cpu(q, k, v, meta)
        n, num_padding = meta.num_actual_tokens, q.shape[0] - meta.num_actual_tokens
        q = q[:n].view(n, self.num_heads, self.head_dim)
        k = k[:n].view(n, self.num_kv_heads, self.head_dim)
        v = v[:n].view(n, self.num_kv_heads, self.head_dim)
        write_kv_cache(k, v, self.kv_cache, meta.slot_mapping)
        out = reference_attention(q, k, v, self.kv_cache, meta, self.scale)
        out = out.reshape(n, self.num_heads * self.head_dim)
        return F.pad(out, (0, 0, 0, num_padding)) if num_padding else out

    def _forward_cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The CPU kernel rotates (with a fused rotary), stores and attends
        the real rows in one call; padding rows of the output are zeros."""
        kernels = load_cpu_kernels()
        assert kernels is not None, "the cpu backend needs the CPU attention kernel"
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if q.shape[0] > meta.num_actual_tokens:
            out[meta.num_actual_tokens :].zero_()
        rotary = self.fused_rotary
        cos_sin = None if rotary is None else rotary.cos_sin_cache
        kernels.attention(out, q, k, v, self.kv_cache, meta.cpu_step_args(), self.scale, cos_sin)
        return out

    def _forward_triton(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every row, padding too: pads store nothing (slot -1) and attend to
        nothing (past ``query_start_loc[-1]``: zeros); only device metadata is
        read, so this runs inside a CUDA graph."""
        from asyncstep.ops.triton.attention import paged_attention, store_kv_cache

        n = q.shape[0]
        if self.fused_rotary is not None and self.fused_decode:
            from asyncstep.ops.triton.attention import rotary_store_and_attend

            assert meta.positions is not None, "a fused rotary needs the positions"
            out = rotary_store_and_attend(
                meta.positions[:n],
                q,
                k,
                v,
                self.fused_rotary.cos_sin_cache,
                self.kv_cache,
                meta.slot_mapping,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_table,
                self.scale,
                uniform_decode=meta.max_query_len == 1,
                max_query_len=meta.max_query_len,
            )
            return out.view(n, self.num_heads * self.head_dim)
        if self.fused_rotary is not None:
            from asyncstep.ops.triton.fused import rotary_and_store_kv

            assert meta.positions is not None, "a fused rotary needs the positions"
            rotary_and_store_kv(
                meta.positions[:n],
                q,
                k,
                v,
                self.fused_rotary.cos_sin_cache,
                self.head_dim,
                self.kv_cache,
                meta.slot_mapping,
            )
        else:
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
            store_kv_cache(k, v, self.kv_cache, meta.slot_mapping)
        out = paged_attention(
            q.view(n, self.num_heads, self.head_dim),
            self.kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            self.scale,
            max_query_len=meta.max_query_len,
        )
        return out.view(n, self.num_heads * self.head_dim)


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (2, num_kv_heads, num_blocks, block_size, head_dim)
