"""A step's attention metadata, as every attention op reads it: where each
request's queries and keys are, the slots its new keys and values go to, and
the reference's plan for the decodes; the paged KV cache's shape.

The KV cache of one layer is ``[2, num_kv_heads, num_blocks, block_size,
head_dim]`` (head-major: one KV head's block is a contiguous ``[block_size,
head_dim]`` tile). Token ``t`` of a step writes its key and value at
``slot_mapping[t] = block_id * block_size + offset`` (-1 for a padding token,
which writes nothing). Requests are ordered decodes first (query length 1).

May import torch and numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "BLOCK_DIM",
    "AttentionMetadata",
    "AttentionShape",
    "DecodeBucket",
    "QkNorm",
    "kv_cache_shape",
    "plan_decode_buckets",
]

#: KV cache dimension of ``[2, kv_heads, blocks, block_size, head_dim]`` holding blocks.
BLOCK_DIM = 2


@dataclass
class DecodeBucket:
    """Decode requests of similar length, attended in one batch."""

    rows: torch.Tensor  # [n] int64: request (= token) rows of the bucket
    block_ids: torch.Tensor  # [n * num_blocks] int64, row-major
    max_len: int
    #: [n] host copy of each request's length (the sliding window's mask reads it).
    lens: np.ndarray
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
    #: An attention op's own view of this metadata, made by the step's
    #: first layer and shared by the others (the CPU kernel's arguments).
    kernel_args: object | None = field(default=None, repr=False)
    #: With several KV cache groups: groups 1.. metadata (group 0's is this
    #: one), which differ in ``block_table``, ``slot_mapping``,
    #: ``decode_buckets`` and ``kernel_args``; empty with one group.
    kv_groups: list[AttentionMetadata] = field(default_factory=list, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


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
        buckets.append(DecodeBucket(rows_t, blocks.reshape(-1).long(), max_len, lens, mask))
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


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's heads (this rank's), softmax scale and sliding
    window: with ``sliding_window`` ``W`` the query at position ``p`` sees
    the keys at ``p - W + 1 .. p`` only (None: every earlier key). A windowed
    layer's metadata may name any block for the keys before its window (the
    KV cache manager frees those blocks, which other requests may then
    hold): an op uses none of them (it may read them and mask them out).

    ``sinks`` (gpt-oss): a learned logit per query head ``[num_heads]``
    (this rank's heads, float32) that joins each query's softmax
    denominator without a value: ``p_i = exp(s_i) / (sum_j exp(s_j) +
    exp(sink))`` (transformers' ``eager_attention_forward``); None: none.
    The layer's parameter itself (loaded in place after the shape is made);
    not compared.

    ``qk_norm`` (Qwen3): the per-head q/k RMSNorms, for an op that applies
    them itself (:attr:`~asyncstep.ops.base.AttentionOp.norms_qk`); an op
    that does not gets q and k normed. Not compared."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)
    qk_norm: QkNorm | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class QkNorm:
    """Per-head q and k RMSNorms: each head of q (of k) times
    ``rsqrt(mean(head^2) + eps)`` in float32, times ``q_weight`` (``k_weight``),
    ``[head_dim]`` each, rounded once to q's dtype (the op set's
    ``qk_rms_norm``). The layer's parameters themselves."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
