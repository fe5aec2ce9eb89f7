"""The reference paged attention against dense causal attention in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncstep.models.layers.attention import (
    AttentionMetadata,
    kv_cache_shape,
    plan_decode_buckets,
    reference_attention,
    write_kv_cache,
)

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [q_len, H, D] at the last positions of k/v [seq, KV, D]; causal, float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    q_len, seq = q.shape[0], k.shape[0]
    mask = torch.ones(q_len, seq, dtype=torch.bool).tril(seq - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "query_lens,computed",
    [
        ([1, 1, 1], [5, 0, 12]),  # decodes only (one with an empty prefix)
        ([7], [0]),  # one prompt, no prefix
        ([1, 1, 5, 3], [9, 3, 0, 6]),  # decodes first, then prompt chunks with prefixes
    ],
)
def test_paged_attention_matches_dense(
    query_lens: list[int], computed: list[int], device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(sum(query_lens) + sum(computed))
    num_blocks = 32
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, DIM))
    # Scatter each request's blocks at random, distinct places in the cache.
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seq_lens = [c + q for c, q in zip(computed, query_lens, strict=True)]
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    full_k, full_v = [], []
    for r, s in enumerate(seq_lens):
        n = -(-s // BLOCK)
        block_table[r, :n] = torch.tensor([free.pop() for _ in range(n)])
        full_k.append(torch.randn(s, KV_HEADS, DIM, generator=gen))
        full_v.append(torch.randn(s, KV_HEADS, DIM, generator=gen))
        # The prefix is already in the cache.
        for pos in range(computed[r]):
            b, off = block_table[r, pos // BLOCK], pos % BLOCK
            kv_cache[0, :, b, off], kv_cache[1, :, b, off] = full_k[r][pos], full_v[r][pos]
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    k_new = torch.cat([full_k[r][computed[r] :] for r in range(len(seq_lens))])
    v_new = torch.cat([full_v[r][computed[r] :] for r in range(len(seq_lens))])
    slots = [
        int(block_table[r, pos // BLOCK]) * BLOCK + pos % BLOCK
        for r in range(len(seq_lens))
        for pos in range(computed[r], seq_lens[r])
    ]
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_decodes = sum(1 for n in query_lens if n == 1)
    meta = AttentionMetadata(
        num_actual_tokens=len(slots),
        num_decodes=num_decodes,
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array(seq_lens),
    )
    kv_cache, q, k_new, v_new = (t.to(device) for t in (kv_cache, q, k_new, v_new))
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(device))
    meta.decode_buckets = plan_decode_buckets(
        meta.seq_lens_cpu[:num_decodes], meta.block_table[:num_decodes], BLOCK, min_bucket=1
    )
    write_kv_cache(k_new, v_new, kv_cache, meta.slot_mapping)
    out = reference_attention(q, k_new, v_new, kv_cache, meta, DIM**-0.5).cpu()
    for r in range(len(seq_lens)):
        expected = dense_attention(q[qsl[r] : qsl[r + 1]].cpu(), full_k[r], full_v[r])
        torch.testing.assert_close(
            out[qsl[r] : qsl[r + 1]].double(), expected, atol=1e-5, rtol=1e-5
        )


def test_write_kv_cache_writes_only_real_tokens() -> None:
    kv_cache = torch.full(kv_cache_shape(4, BLOCK, KV_HEADS, DIM), -7.0)
    k = torch.randn(3, KV_HEADS, DIM)
    v = torch.randn(3, KV_HEADS, DIM)
    # Two padding slots (-1) follow the three real tokens.
    slot_mapping = torch.tensor([5, 0, 13, -1, -1])
    write_kv_cache(k, v, kv_cache, slot_mapping)
    by_slot_k = kv_cache[0].reshape(KV_HEADS, -1, DIM).transpose(0, 1)  # [slot, head, dim]
    by_slot_v = kv_cache[1].reshape(KV_HEADS, -1, DIM).transpose(0, 1)
    torch.testing.assert_close(by_slot_k[[5, 0, 13]], k)
    torch.testing.assert_close(by_slot_v[[5, 0, 13]], v)
    untouched = [s for s in range(4 * BLOCK) if s not in {0, 5, 13}]
    assert bool((by_slot_k[untouched] == -7.0).all())


def test_decode_buckets_cut_where_padding_is_wasted() -> None:
    lens = np.array([100, 5, 7, 98, 6, 99])
    table = torch.arange(6 * 25, dtype=torch.int32).view(6, 25)
    buckets = plan_decode_buckets(lens, table, BLOCK, max_buckets=2, min_bucket=2)
    assert [sorted(b.rows.tolist()) for b in buckets] == [[1, 2, 4], [0, 3, 5]]
    assert [b.max_len for b in buckets] == [7, 100]
    short = buckets[0]
    assert short.block_ids.tolist() == table[short.rows][:, :2].reshape(-1).tolist()
    assert short.mask is not None and short.mask.shape == (3, 1, 1, 7)
