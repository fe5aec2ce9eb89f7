"""Attention over a paged KV cache: the metadata a step's attention needs,
and the reference backend in plain torch (runs on CPU and CUDA).

The KV cache of one layer is ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``; token ``t`` of a step writes its key and value at
``slot_mapping[t] = block_id * block_size + offset`` (-1 for a padding token,
which writes nothing). Requests are ordered decodes first (query length 1),
so decodes run as one batched gather, and prompt chunks one request at a time
over their cached prefix plus the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


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

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each real token's key/value at its slot.

    ``key``/``value`` hold the step's real tokens only; padding tokens (slot
    -1) come after them in ``slot_mapping`` and are never written.
    """
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    n = key.shape[0]
    slots = slot_mapping[:n]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def _gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``block_ids`` (one row per request): [rows, length, kv_heads, dim]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    rows = block_ids.shape[0]
    k = kv_cache[0][block_ids].view(rows, -1, num_kv_heads, head_dim)[:, :length]
    v = kv_cache[1][block_ids].view(rows, -1, num_kv_heads, head_dim)[:, :length]
    return k, v


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Every decode request at once: q [n, heads, dim] -> [n, heads, dim]."""
    n = meta.num_decodes
    block_size = kv_cache.shape[2]
    max_len = int(meta.seq_lens_cpu[:n].max())
    num_blocks = -(-max_len // block_size)
    k, v = _gather_kv(kv_cache, meta.block_table[:n, :num_blocks], max_len)
    mask = torch.arange(max_len, device=q.device)[None, :] < meta.seq_lens[:n, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [n, heads, 1, dim]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


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
        k, v, mask, causal = k_new, v_new, None, True
    else:
        block_size = kv_cache.shape[2]
        blocks = meta.block_table[req : req + 1, : -(-seq_len // block_size)]
        k, v = (t[0] for t in _gather_kv(kv_cache, blocks, seq_len))
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [heads, q_len, dim]
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Paged attention in plain torch. q [tokens, heads, dim], k/v [tokens, kv_heads, dim]
    (already written to the cache). Returns [tokens, heads, dim]."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_attention(q[:nd], kv_cache, meta, scale)
    qsl = meta.query_start_loc_cpu
    for req in range(nd, meta.num_reqs):
        s, e = int(qsl[req]), int(qsl[req + 1])
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], kv_cache, meta, req, scale)
    return out


class Attention(nn.Module):
    """Writes this layer's keys/values into its paged cache, then attends.

    The runner binds ``kv_cache`` once the cache is allocated.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = meta.num_actual_tokens
        q = q[:n].view(n, self.num_heads, self.head_dim)
        k = k[:n].view(n, self.num_kv_heads, self.head_dim)
        v = v[:n].view(n, self.num_kv_heads, self.head_dim)
        write_kv_cache(k, v, self.kv_cache, meta.slot_mapping)
        out = reference_attention(q, k, v, self.kv_cache, meta, self.scale)
        return out.reshape(n, self.num_heads * self.head_dim)
