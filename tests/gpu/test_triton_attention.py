"""The Triton paged-attention kernels (``store_kv_cache``, ``paged_attention``)
against dense causal attention in float64 and against the torch reference
backend: decodes, prompts, chunked prompts over a cached prefix, mixed
batches, padded requests and padding rows, strided inputs, new metadata
values under the same shapes (what a CUDA-graph replay does), and the
ValueErrors. Decode-shaped batches (as many tokens as requests) take the
split-KV path: forced split counts check the segments and their combination.

On the CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``,
set before triton is imported), in float32; ``ASYNCSTEP_TEST_DEVICE=cuda``
compiles them and adds bfloat16 and a real CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels need triton")

import numpy as np  # noqa: E402

from asyncstep.models.layers.attention import (  # noqa: E402
    AttentionMetadata,
    kv_cache_shape,
    plan_decode_buckets,
    reference_attention,
    write_kv_cache,
)
from asyncstep.ops.triton import attention as triton_attention  # noqa: E402
from asyncstep.ops.triton.attention import paged_attention, store_kv_cache  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4
NUM_BLOCKS = 96
TABLE_WIDTH = 40  # block table columns: the longest test sequence needs 36
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
#: (atol, rtol) against float64: fp32 kernels are exact up to rounding, bf16 keeps 8 bits.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


@dataclass
class Batch:
    """One step's inputs, with every request's full keys/values for the reference."""

    q: torch.Tensor  # [num_tokens, heads, dim]
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    keys: list[torch.Tensor]  # per request [seq_len, kv_heads, dim]
    values: list[torch.Tensor]
    query_lens: list[int]
    computed: list[int]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens)

    def run(self, out: torch.Tensor | None = None) -> torch.Tensor:
        dim = self.q.shape[-1]
        return paged_attention(
            self.q,
            self.kv_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            dim**-0.5,
            out=out,
        )


def make_batch(
    query_lens: list[int],
    computed: list[int],
    *,
    num_padding: int = 0,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    dim: int = DIM,
    dtype: torch.dtype = torch.float32,
    fused_q: bool = False,
    table_in_buffer: bool = False,
    block_size: int = BLOCK,
    num_blocks: int = NUM_BLOCKS,
    table_width: int = TABLE_WIDTH,
    seed: int = 0,
) -> Batch:
    """Requests with ``query_lens[r]`` new tokens after ``computed[r]`` cached
    ones (both 0: a padded request), their keys already in the cache at random
    blocks; ``num_padding`` padding rows after the real tokens. The rest of the
    cache and of the block table hold random values, so a wrong read shows."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    kv_cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, dim), generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    # Unused entries point at random (valid) blocks.
    table = torch.randint(0, num_blocks, (len(seq_lens) + 3, table_width + 2), generator=gen)
    table = table.to(torch.int32)
    n = len(seq_lens)
    rows = table[1 : 1 + n, :table_width]
    if not table_in_buffer:
        rows = rows.clone()
    keys, values = [], []
    for r, s in enumerate(seq_lens):
        blocks = torch.tensor([free.pop() for _ in range(-(-s // block_size))], dtype=torch.int64)
        rows[r, : len(blocks)] = blocks.to(torch.int32)
        keys.append(torch.randn(s, kv_heads, dim, generator=gen).to(dtype))
        values.append(torch.randn(s, kv_heads, dim, generator=gen).to(dtype))
        pos = torch.arange(s)
        slot = blocks[pos // block_size], pos % block_size
        kv_cache[0][:, slot[0], slot[1]] = keys[r].float().transpose(0, 1)
        kv_cache[1][:, slot[0], slot[1]] = values[r].float().transpose(0, 1)
    num_tokens = sum(query_lens) + num_padding
    if fused_q:  # q as a view of a fused [tokens, (heads + 2 * kv_heads) * dim] projection
        qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen)
        q = qkv.to(dtype).to(DEVICE)[:, : heads * dim].view(num_tokens, heads, dim)
        assert not q.is_contiguous()
    else:
        q = torch.randn(num_tokens, heads, dim, generator=gen).to(dtype).to(DEVICE)
    qsl = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    if table_in_buffer:
        table = table.to(DEVICE)
        block_table = table[1 : 1 + len(seq_lens), :table_width]
        assert not block_table.is_contiguous()
    else:
        block_table = rows.to(DEVICE)
    return Batch(
        q=q,
        kv_cache=kv_cache.to(dtype).to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table,
        keys=keys,
        values=values,
        query_lens=query_lens,
        computed=computed,
    )


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [q_len, H, D] at the last positions of k/v [seq, KV, D]; causal, float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    q_len, seq = q.shape[0], k.shape[0]
    mask = torch.ones(q_len, seq, dtype=torch.bool).tril(seq - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def assert_matches_dense(batch: Batch, out: torch.Tensor) -> None:
    """Every request's rows equal dense attention; padding rows are zeros."""
    atol, rtol = TOLERANCE[batch.q.dtype]
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out, q = out.cpu(), batch.q.cpu()
    qsl = batch.query_start_loc.tolist()
    for r in range(len(batch.query_lens)):
        s, e = qsl[r], qsl[r + 1]
        if e > s:
            expected = dense_attention(q[s:e], batch.keys[r], batch.values[r])
            torch.testing.assert_close(out[s:e].double(), expected, atol=atol, rtol=rtol)
    assert bool((out[batch.num_real_tokens :] == 0).all()), "padding rows must be zeros"


# --------------------------------------------------------------------------
# store_kv_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,dim", [(2, 16), (3, 8), (2, 64)])
def test_store_writes_real_slots_only(kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    num_blocks, num_tokens = 6, 5
    cache = torch.randn(kv_cache_shape(num_blocks, BLOCK, kv_heads, dim)).to(dtype).to(DEVICE)
    before = cache.clone()
    # Key and value as strided views out of a fused qkv projection.
    qkv = torch.randn(num_tokens, (HEADS + 2 * kv_heads) * dim).to(dtype).to(DEVICE)
    k = qkv[:, HEADS * dim : (HEADS + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    v = qkv[:, (HEADS + kv_heads) * dim :].view(num_tokens, kv_heads, dim)
    # Token 2 is padding (-1); entries past num_tokens are never used.
    slots = torch.tensor([13, 0, -1, 22, 5, 7, 8], device=DEVICE)
    store_kv_cache(k, v, cache, slots)

    expected = before.clone()
    write_kv_cache(k[[0, 1, 3, 4]], v[[0, 1, 3, 4]], expected, slots[[0, 1, 3, 4]])
    assert torch.equal(cache, expected)
    by_slot = cache.view(2, kv_heads, -1, dim)
    assert torch.equal(by_slot[0, :, 22], k[3]) and torch.equal(by_slot[1, :, 5], v[4])
    assert torch.equal(by_slot[:, :, 7], before.view(2, kv_heads, -1, dim)[:, :, 7])


def test_store_of_no_tokens_is_a_no_op() -> None:
    cache = torch.randn(kv_cache_shape(2, BLOCK, KV_HEADS, DIM), device=DEVICE)
    before = cache.clone()
    empty = torch.empty(0, KV_HEADS, DIM, device=DEVICE)
    store_kv_cache(empty, empty, cache, torch.full((4,), -1, device=DEVICE))
    assert torch.equal(cache, before)


# --------------------------------------------------------------------------
# paged_attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(4, 2, 16), (6, 2, 8), (4, 4, 32), (8, 2, 64), (2, 1, 128)],
)
def test_decode_batch(heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    """Decodes only (one query token per tile): GQA groups 1, 2, 3, 4; contexts
    from 1 key to several 64-key tiles (63 and 64 keys: either side of a tile
    edge), spread over many blocks."""
    batch = make_batch(
        [1] * 6, [0, 3, 17, 62, 63, 140], heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype
    )
    assert_matches_dense(batch, batch.run())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_len", [7, 100])
def test_prefill_without_prefix(query_len: int, dtype: torch.dtype) -> None:
    """A prompt: its queries span several query tiles and key tiles when long."""
    batch = make_batch([query_len], [0], dtype=dtype)
    assert_matches_dense(batch, batch.run())


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_over_cached_prefix(dtype: torch.dtype) -> None:
    # The first chunk starts at position 62: its first query tile ends at a key-tile edge.
    batch = make_batch([20, 45], [62, 70], heads=6, kv_heads=2, dtype=dtype)
    assert_matches_dense(batch, batch.run())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_matches_reference_backend(dtype: torch.dtype) -> None:
    """Decodes first, then prompt chunks (with and without a prefix): equal to
    dense attention and to the torch reference backend."""
    query_lens, computed = [1, 1, 1, 9, 33], [0, 12, 66, 0, 40]
    batch = make_batch(query_lens, computed, dtype=dtype)
    out = batch.run()
    assert_matches_dense(batch, out)

    qsl = batch.query_start_loc.cpu().numpy()
    seq_lens = batch.seq_lens.cpu().numpy()
    meta = AttentionMetadata(
        num_actual_tokens=batch.num_real_tokens,
        num_decodes=3,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=torch.empty(0, dtype=torch.int64, device=DEVICE),  # keys already stored
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    meta.decode_buckets = plan_decode_buckets(seq_lens[:3], batch.block_table[:3], BLOCK)
    q = batch.q.double()
    k_new = torch.cat([batch.keys[r][computed[r] :] for r in range(5)]).double().to(DEVICE)
    v_new = torch.cat([batch.values[r][computed[r] :] for r in range(5)]).double().to(DEVICE)
    expected = reference_attention(q, k_new, v_new, batch.kv_cache.double(), meta, DIM**-0.5)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "query_lens,computed,num_padding",
    [([1, 1, 0, 0], [9, 30, 0, 0], 2), ([1, 5, 0], [9, 30, 0], 3)],
    ids=["decode-shape", "mixed"],
)
def test_padded_requests_and_padding_rows(
    query_lens: list[int], computed: list[int], num_padding: int
) -> None:
    """Padded requests (seq_len 0, empty query range) produce nothing; padding
    rows past the last request are written as zeros (``out`` starts as NaN).
    ``decode-shape`` has as many tokens as requests: the one-token-tile path."""
    batch = make_batch(query_lens, computed, num_padding=num_padding)
    out = torch.full_like(batch.q, float("nan"))
    assert batch.run(out=out) is out
    assert_matches_dense(batch, out)


def test_only_padding() -> None:
    batch = make_batch([0, 0], [0, 0], num_padding=5)
    assert_matches_dense(batch, batch.run(out=torch.full_like(batch.q, float("nan"))))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_q_and_block_table_row_slice(dtype: torch.dtype) -> None:
    """q is a column slice of a fused qkv tensor; the block table rows are a
    slice of a wider buffer (its strides are used)."""
    batch = make_batch(
        [1, 1, 12], [7, 30, 5], fused_q=True, table_in_buffer=True, dtype=dtype, num_padding=1
    )
    assert_matches_dense(batch, batch.run())


@pytest.mark.parametrize(
    "first,second",
    [
        (([1, 1, 1], [5, 60, 0]), ([1, 0, 2], [70, 0, 3])),
        (([4, 9, 0], [0, 3, 0]), ([1, 1, 11], [20, 0, 64])),
    ],
    ids=["decode-shape", "prefill-shape"],
)
def test_same_shapes_new_values(
    first: tuple[list[int], list[int]], second: tuple[list[int], list[int]]
) -> None:
    """What a CUDA-graph replay does: the same tensors (shapes, addresses),
    new query_start_loc / seq_lens / block_table values, and the answer follows
    the values."""
    a, b = make_batch(*first, seed=1), make_batch(*second, seed=2)
    assert a.q.shape == b.q.shape
    out = a.run()
    assert_matches_dense(a, out)
    for name in ("q", "kv_cache", "query_start_loc", "seq_lens"):
        getattr(a, name).copy_(getattr(b, name))
    a.block_table[:, : b.block_table.shape[1]] = b.block_table
    a.run(out=out)
    assert_matches_dense(b, out)


# --------------------------------------------------------------------------
# paged_attention: decode batches on the split-KV path


def force_decode_splits(monkeypatch: pytest.MonkeyPatch, num_splits: int) -> None:
    """Make decode batches use ``num_splits`` key segments, whatever their shape."""
    choose = triton_attention._decode_launch

    def forced(*args: Any) -> triton_attention._DecodeLaunch:
        return dataclasses.replace(choose(*args), num_splits=num_splits)

    monkeypatch.setattr(triton_attention, "_decode_launch", forced)


#: Decode contexts (block size 16; fp32 key tiles of 32, bf16 of 64): 1 key,
#: one tile exactly (32), a tile and a key (65), several segments with a tail
#: (201, 334); at 16 splits most segments are empty (fewer tiles than splits).
SPLIT_CONTEXTS = [0, 31, 64, 200, 333]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,num_splits",
    [(2, 2, 3), (8, 2, 5), (8, 1, 16), (8, 2, 1)],
    ids=["group1-3splits", "group4-5splits", "group8-16splits", "group4-1split"],
)
def test_decode_split_kv(
    heads: int, kv_heads: int, num_splits: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Segments of ``cdiv(keys, splits)`` rounded up to the key tile, combined
    by their log-sum-exp; 1 split: the kernel writes ``out`` itself."""
    force_decode_splits(monkeypatch, num_splits)
    n = len(SPLIT_CONTEXTS)
    batch = make_batch(
        [1] * n,
        SPLIT_CONTEXTS,
        heads=heads,
        kv_heads=kv_heads,
        dim=32,
        dtype=dtype,
        block_size=16,
        num_blocks=64,
        table_width=24,
        seed=num_splits,
    )
    out = torch.full_like(batch.q, float("nan"))
    batch.run(out=out)
    assert_matches_dense(batch, out)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_split_kv_padding_and_multi_token_request(
    num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode shape (tokens == requests) with padded requests (seq_len 0),
    padding rows (zeros; ``out`` starts as NaN) and a request of 2 tokens (its
    tokens see 66 and 67 keys: segments end at each token's causal end)."""
    force_decode_splits(monkeypatch, num_splits)
    batch = make_batch(
        [1, 0, 2, 1, 0, 0],
        [40, 0, 65, 0, 0, 0],
        num_padding=2,
        heads=8,
        kv_heads=2,
        block_size=16,
        num_blocks=64,
        table_width=24,
    )
    assert batch.q.shape[0] == batch.seq_lens.shape[0]
    out = torch.full_like(batch.q, float("nan"))
    batch.run(out=out)
    assert_matches_dense(batch, out)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_short_queries_take_the_split_kv_kernels(
    num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A speculative verify step's queries (``1 + k`` tokens a request, some
    fewer, a padded request, padding rows), given ``max_query_len``, run the
    split-KV kernels: each token attends its request's keys up to its own
    position, as dense attention does; padding rows zeros. Without the
    bound, or past :data:`MAX_SPLIT_KV_QUERY_LEN`, the query-tiled kernel."""
    force_decode_splits(monkeypatch, num_splits)
    decode_calls: list[int] = []
    paged_decode = triton_attention._paged_decode

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        decode_calls.append(q.shape[0])
        paged_decode(q, *args, **kwargs)

    monkeypatch.setattr(triton_attention, "_paged_decode", spy)
    batch = make_batch(
        [4, 2, 0, 4],
        [37, 70, 0, 1],
        num_padding=3,
        heads=8,
        kv_heads=2,
        block_size=16,
        num_blocks=64,
        table_width=24,
        seed=num_splits,
    )
    dim = batch.q.shape[-1]
    args = (batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(*args, dim**-0.5, out=out, max_query_len=4)
    assert decode_calls == [batch.q.shape[0]]
    assert_matches_dense(batch, out)
    limit = triton_attention.MAX_SPLIT_KV_QUERY_LEN
    tiled = paged_attention(*args, dim**-0.5, max_query_len=limit + 1)
    untold = paged_attention(*args, dim**-0.5)
    assert decode_calls == [batch.q.shape[0]]  # neither took the split kernels
    assert_matches_dense(batch, tiled)
    assert_matches_dense(batch, untold)


def test_decode_split_count_follows_the_shape_only() -> None:
    """Enough programs for about 2 per SM, 1 .. 16 splits; no seq_lens argument."""

    def splits(num_tokens: int, kv_heads: int = 8, sms: int = 132) -> int:
        return triton_attention._decode_launch(
            num_tokens, kv_heads, 4, 128, torch.bfloat16, sms
        ).num_splits

    assert triton_attention.DECODE_PROGRAMS_PER_SM == 2
    assert [splits(n) for n in (1, 8, 32, 33, 64, 128, 1024)] == [16, 5, 2, 1, 1, 1, 1]
    assert splits(32, sms=8) == 1 and splits(1, kv_heads=1) == 16


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "first,second",
    [
        (([1, 1, 6, 0], [20, 3, 40, 0], 2), ([1, 0, 9, 0], [90, 0, 1, 0], 0)),
        # Decode shape: the split-KV path (16 splits at this size) and its scratch.
        (([1, 1, 1, 0], [20, 3, 140, 0], 1), ([1, 0, 2, 1], [90, 0, 1, 150], 0)),
    ],
    ids=["mixed", "decode-split"],
)
def test_cuda_graph_replay_with_new_metadata(
    first: tuple[list[int], list[int], int],
    second: tuple[list[int], list[int], int],
    dtype: torch.dtype,
) -> None:
    a = make_batch(first[0], first[1], num_padding=first[2], dtype=dtype, seed=1)
    b = make_batch(second[0], second[1], num_padding=second[2], dtype=dtype, seed=2)
    assert a.q.shape == b.q.shape and a.block_table.shape == b.block_table.shape
    out = torch.empty_like(a.q)
    a.run(out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a.run(out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_dense(a, out)
    for name in ("q", "kv_cache", "query_start_loc", "seq_lens", "block_table"):
        getattr(a, name).copy_(getattr(b, name))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_dense(b, out)


def _bad_call(**changes: Any) -> Callable[[], torch.Tensor]:
    """paged_attention on a small valid batch with some arguments replaced."""
    batch = make_batch([1, 3], [4, 0])
    args: dict[str, Any] = {
        "q": batch.q,
        "kv_cache": batch.kv_cache,
        "query_start_loc": batch.query_start_loc,
        "seq_lens": batch.seq_lens,
        "block_table": batch.block_table,
        "scale": 0.25,
        "out": None,
    }
    args.update(changes)
    return lambda: paged_attention(**args)


def _meta(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"q": torch.zeros(4, HEADS * DIM, device=DEVICE)}, "q must have 3 dimensions"),
        ({"q": torch.zeros(4, 3, DIM, device=DEVICE)}, "not a multiple of 2 KV heads"),
        ({"q": torch.zeros(4, HEADS, 8, device=DEVICE)}, "kv_cache shape"),
        ({"q": torch.zeros(4, HEADS, DIM, device=DEVICE).double()}, "does not match"),
        ({"q": torch.zeros(4, HEADS, DIM, dtype=torch.bfloat16, device=DEVICE)}, "match"),
        ({"kv_cache": torch.zeros(2, KV_HEADS, 4, DIM, device=DEVICE)}, "kv_cache must have 5"),
        ({"kv_cache": _meta(kv_cache_shape(8, BLOCK, KV_HEADS, DIM))}, "kv_cache is on meta"),
        ({"query_start_loc": torch.tensor([0, 1, 4], device=DEVICE)}, "must be torch.int32"),
        ({"query_start_loc": torch.zeros(2, dtype=torch.int32, device=DEVICE)}, "3 entries"),
        ({"seq_lens": torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)}, "seq_lens must"),
        ({"block_table": torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)}, "2 rows"),
        ({"block_table": torch.zeros(2, 4, device=DEVICE)}, "block_table must be torch.int32"),
        ({"out": torch.zeros(5, HEADS, DIM, device=DEVICE)}, "out is"),
    ],
)
def test_paged_attention_rejects_bad_arguments(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _bad_call(**changes)()


def test_store_rejects_bad_arguments() -> None:
    cache = torch.zeros(kv_cache_shape(4, BLOCK, KV_HEADS, DIM), device=DEVICE)
    k = torch.zeros(3, KV_HEADS, DIM, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    cases: list[tuple[Callable[[], None], str]] = [
        (lambda: store_kv_cache(k[:, :1], k, cache, slots), "value shape"),
        (lambda: store_kv_cache(k[:, :1], k[:, :1], cache, slots), "kv_cache shape"),
        (lambda: store_kv_cache(k.double(), k.double(), cache, slots), "does not match"),
        (lambda: store_kv_cache(k, k, cache, slots.int()), "must be torch.int64"),
        (lambda: store_kv_cache(k, k, cache, slots[:2]), "2 entries for 3 tokens"),
        (lambda: store_kv_cache(k[0], k[0], cache, slots), "key must have 3"),
        (lambda: store_kv_cache(k, k, cache, slots.to("meta")), "slot_mapping is on meta"),
        (lambda: store_kv_cache(k, k, cache.long(), slots), "kv_cache dtype"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
