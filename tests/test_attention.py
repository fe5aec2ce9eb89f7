"""The reference paged attention against dense causal attention in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncstep.models.layers.attention import (
    AttentionMetadata,
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
def test_paged_attention_matches_dense(query_lens: list[int], computed: list[int]) -> None:
    gen = torch.Generator().manual_seed(sum(query_lens) + sum(computed))
    num_blocks = 32
    kv_cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, DIM)
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
            kv_cache[0, b, off], kv_cache[1, b, off] = full_k[r][pos], full_v[r][pos]
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    k_new = torch.cat([full_k[r][computed[r] :] for r in range(len(seq_lens))])
    v_new = torch.cat([full_v[r][computed[r] :] for r in range(len(seq_lens))])
    slots = [
        int(block_table[r, pos // BLOCK]) * BLOCK + pos % BLOCK
        for r in range(len(seq_lens))
        for pos in range(computed[r], seq_lens[r])
    ]
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    meta = AttentionMetadata(
        num_actual_tokens=len(slots),
        num_decodes=sum(1 for n in query_lens if n == 1),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array(seq_lens),
    )
    write_kv_cache(k_new, v_new, kv_cache, meta.slot_mapping)
    out = reference_attention(q, k_new, v_new, kv_cache, meta, DIM**-0.5)
    for r in range(len(seq_lens)):
        expected = dense_attention(q[qsl[r] : qsl[r + 1]], full_k[r], full_v[r])
        torch.testing.assert_close(
            out[qsl[r] : qsl[r + 1]].double(), expected, atol=1e-5, rtol=1e-5
        )


def test_write_kv_cache_writes_only_real_tokens() -> None:
    kv_cache = torch.full((2, 4, BLOCK, KV_HEADS, DIM), -7.0)
    k = torch.randn(3, KV_HEADS, DIM)
    v = torch.randn(3, KV_HEADS, DIM)
    # Two padding slots (-1) follow the three real tokens.
    slot_mapping = torch.tensor([5, 0, 13, -1, -1])
    write_kv_cache(k, v, kv_cache, slot_mapping)
    flat_k = kv_cache[0].view(-1, KV_HEADS, DIM)
    torch.testing.assert_close(flat_k[[5, 0, 13]], k)
    written = {0, 5, 13}
    untouched = [s for s in range(4 * BLOCK) if s not in written]
    assert bool((flat_k[untouched] == -7.0).all())
    assert bool((kv_cache[1].view(-1, KV_HEADS, DIM)[[5, 0, 13]] == v).all())
