"""Unit tests of the paged KV block manager and its automatic prefix caching."""

from __future__ import annotations

import pytest

from asyncstep.datatypes import SamplingParams
from asyncstep.engine.core.kv_cache_manager import (
    BlockPool,
    KVCacheManager,
    KVCacheStats,
    hash_block_tokens,
)
from asyncstep.engine.core.request import Request, RequestStatus

BS = 4


def make_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), eos_token_ids={0})


def compute(mgr: KVCacheManager, request: Request, num_tokens: int) -> list[int] | None:
    """What one scheduled step does: allocate, then the step 'computes' the tokens."""
    new = mgr.allocate_slots(request, num_tokens)
    if new is not None:
        request.num_computed_tokens += num_tokens
    return new


def assert_pool_clean(mgr: KVCacheManager) -> None:
    pool = mgr.block_pool
    assert mgr.num_free_blocks == mgr.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(pool.free_block_ids()) == list(range(mgr.num_blocks))
    assert mgr.usage == 0.0


def ref_cnts(mgr: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [mgr.block_pool.blocks[i].ref_cnt for i in block_ids]


# -- allocation ---------------------------------------------------------------


def test_allocate_grows_block_table_and_returns_only_new_blocks() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(1, 7)))  # 6 tokens
    assert compute(mgr, req, 6) == [0, 1]
    assert mgr.get_block_ids("a") == [0, 1]
    req.append_output_token_ids(7)
    assert compute(mgr, req, 1) == []  # token 7 fits in block 1
    req.append_output_token_ids(8)
    assert compute(mgr, req, 1) == []
    req.append_output_token_ids(9)
    assert compute(mgr, req, 1) == [2]  # token 9 starts a third block
    assert mgr.num_free_blocks == 5
    assert mgr.usage == pytest.approx(3 / 8)
    mgr.free(req)
    assert mgr.get_block_ids("a") == []
    assert_pool_clean(mgr)


def test_allocate_returns_none_and_takes_nothing_when_short() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(1, 9)))
    assert compute(mgr, a, 8) == [0, 1]
    b = make_request("b", list(range(20, 29)))  # 9 tokens: 3 blocks, only 1 free
    assert mgr.allocate_slots(b, 9) is None
    assert mgr.get_block_ids("b") == []
    assert mgr.num_free_blocks == 1
    assert mgr.allocate_slots(b, 4) == [2]  # a chunk that fits
    mgr.free(a)
    mgr.free(b)
    assert_pool_clean(mgr)


def test_free_returns_blocks_last_first_to_the_lru_tail() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(1, 13)))
    assert compute(mgr, a, 12) == [0, 1, 2]
    assert mgr.block_pool.free_block_ids() == [3, 4, 5]
    mgr.free(a)
    # The tail of a's sequence is evicted first, its first block last.
    assert mgr.block_pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert_pool_clean(mgr)


def test_free_twice_and_unknown_request_are_harmless() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 2, 3])
    compute(mgr, a, 3)
    mgr.free(a)
    mgr.free(a)
    mgr.free(make_request("never", [1]))
    assert_pool_clean(mgr)


def test_block_pool_rejects_overdraw_and_double_free() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


# -- prefix caching -------------------------------------------------------------


def test_hash_is_deterministic_and_chained() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])


def test_shared_prefix_shares_blocks_with_refcount_two() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2
    assert compute(mgr, a, 10) == [0, 1, 2]
    a.append_output_token_ids(99)
    compute(mgr, a, 1)  # the next step registers a's computed full blocks
    assert mgr.statistics().num_cached_blocks == 2

    b = make_request("b", [*range(1, 9), 50, 51, 52])  # same first 8 tokens
    hit_ids, num_computed = mgr.get_computed_blocks(b)
    assert hit_ids == [0, 1]
    assert num_computed == 8
    assert ref_cnts(mgr, [0, 1, 2]) == [2, 2, 1]
    b.num_computed_tokens = num_computed
    assert compute(mgr, b, b.num_tokens - num_computed) == [3]
    assert mgr.get_block_ids("b") == [0, 1, 3]

    stats = mgr.statistics()
    assert stats.prefix_cache_queries == 11
    assert stats.prefix_cache_hits == 8
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 11)

    mgr.free(a)
    assert ref_cnts(mgr, [0, 1, 2]) == [1, 1, 0]
    mgr.free(b)
    assert_pool_clean(mgr)


def test_same_tokens_after_a_different_prefix_do_not_hit() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(mgr, a, 9)
    mgr.free(a)
    # b's first block holds the tokens of a's second one, at another position.
    b = make_request("b", [5, 6, 7, 8, 5, 6, 7, 8, 9])
    assert mgr.get_computed_blocks(b) == ([], 0)
    mgr.free(b)
    assert_pool_clean(mgr)


def test_hit_never_covers_the_whole_prompt() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(1, 13)))  # exactly 3 full blocks
    compute(mgr, a, 12)
    mgr.free(a)  # freeing registers the computed full blocks
    assert mgr.statistics().num_cached_blocks == 3

    same = make_request("same", list(range(1, 13)))
    hit_ids, num_computed = mgr.get_computed_blocks(same)
    assert num_computed == 8  # (12 - 1) // 4 blocks: the last token is recomputed
    assert hit_ids == mgr.get_block_ids("same")
    assert num_computed < same.num_tokens
    mgr.free(same)

    short = make_request("short", [1, 2, 3, 4])
    assert mgr.get_computed_blocks(short) == ([], 0)
    mgr.free(short)
    assert_pool_clean(mgr)


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(1, 10)))  # 9 tokens: blocks 0, 1 full
    compute(mgr, a, 9)
    mgr.free(a)
    assert mgr.block_pool.free_block_ids() == [3, 2, 1, 0]
    b = make_request("b", list(range(1, 10)))
    hit_ids, _ = mgr.get_computed_blocks(b)
    assert hit_ids == [0, 1]
    assert mgr.block_pool.free_block_ids() == [3, 2]
    assert ref_cnts(mgr, [0, 1]) == [1, 1]
    mgr.free(b)
    assert_pool_clean(mgr)


def test_eviction_drops_hashes() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(1, 10)))
    compute(mgr, a, 9)  # blocks 0, 1, 2
    mgr.free(a)
    assert mgr.statistics().num_cached_blocks == 2
    assert [b.block_hash is not None for b in mgr.block_pool.blocks] == [True, True, False, False]

    # Free order is [3, 2, 1, 0]: three new blocks evict 3, 2 and 1 (a's second block).
    c = make_request("c", list(range(100, 112)))
    assert compute(mgr, c, 12) == [3, 2, 1]
    assert mgr.block_pool.blocks[1].block_hash is None
    assert mgr.statistics().num_cached_blocks == 1

    b = make_request("b", list(range(1, 10)))
    hit_ids, num_computed = mgr.get_computed_blocks(b)
    assert (hit_ids, num_computed) == ([0], 4)  # only the first block survived
    mgr.free(b)
    mgr.free(c)
    assert_pool_clean(mgr)


def test_same_contents_computed_twice_are_both_cached() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(1, 6)))
    b = make_request("b", list(range(1, 6)))
    for req in (a, b):  # both computed in the same step: no hit for b
        assert mgr.get_computed_blocks(req) == ([], 0)
        compute(mgr, req, 5)
    mgr.free(a)
    mgr.free(b)
    assert mgr.statistics().num_cached_blocks == 2
    # Evict a's first block (free order: ..., 1, 0, 3, 2): b's copy still hits.
    filler = make_request("f", list(range(50, 74)))
    mgr.allocate_slots(filler, 4 * 6)
    assert mgr.block_pool.blocks[0].block_hash is None
    assert mgr.statistics().num_cached_blocks == 1
    mgr.free(filler)
    c = make_request("c", list(range(1, 7)))
    assert mgr.get_computed_blocks(c) == ([2], 4)
    mgr.free(c)
    assert_pool_clean(mgr)


def test_resumed_request_hits_its_own_blocks_including_outputs() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", [1, 2, 3])
    compute(mgr, a, 3)
    for tok in (4, 5, 6):  # three decode steps: tokens 4, 5 computed, 6 sampled last
        a.append_output_token_ids(tok)
        compute(mgr, a, 1)
    a.append_output_token_ids(7)
    assert a.num_computed_tokens == 6
    # Preempted: freed, recompute from scratch, but its first full block is cached.
    mgr.free(a)
    a.num_computed_tokens = 0
    a.status = RequestStatus.PREEMPTED
    hit_ids, num_computed = mgr.get_computed_blocks(a)
    assert (hit_ids, num_computed) == ([0], 4)
    mgr.free(a)
    assert_pool_clean(mgr)


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(1, 10)))
    compute(mgr, a, 9)
    mgr.free(a)
    b = make_request("b", list(range(1, 10)))
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert b.block_hashes == []
    stats = mgr.statistics()
    assert stats == KVCacheStats(
        num_blocks=8,
        num_free_blocks=8,
        num_cached_blocks=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    mgr.free(b)
    assert_pool_clean(mgr)


def test_get_computed_blocks_requires_an_empty_block_table() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(mgr, a, 5)
    with pytest.raises(RuntimeError):
        mgr.get_computed_blocks(a)
    mgr.free(a)
    assert_pool_clean(mgr)


# -- the decode limit (the scheduler's fast path) -------------------------------


def test_hash_is_sha256_of_parent_and_int64_tokens() -> None:
    """The block hash format: sha256(parent or root, the tokens as native int64s)."""
    import hashlib
    from array import array

    from asyncstep.engine.core.kv_cache_manager import _ROOT_HASH

    tokens = [0, 1, 31999, 2**40, 7]
    want = hashlib.sha256(_ROOT_HASH + array("q", tokens).tobytes()).digest()
    assert hash_block_tokens(None, tokens) == want
    chained = hashlib.sha256(want + array("q", tokens[:2]).tobytes()).digest()
    assert hash_block_tokens(want, tokens[:2]) == chained
    assert hash_block_tokens(None, []) == hashlib.sha256(_ROOT_HASH).digest()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_decode_limit_follows_blocks_and_registrations(prefix_caching: bool) -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=prefix_caching)
    req = make_request("a", list(range(1, 7)))  # 6 tokens
    assert "a" not in mgr.decode_limits
    assert compute(mgr, req, 6) == [0, 1]
    # Block 0 is full and computed but not registered yet (at the next call):
    # with prefix caching the limit stops before it, so that call is not skipped.
    assert mgr.decode_limits["a"] == (4 if prefix_caching else 8)
    req.append_output_token_ids(7)
    assert compute(mgr, req, 1) == []  # registers block 0
    assert mgr.statistics().num_cached_blocks == (1 if prefix_caching else 0)
    assert mgr.decode_limits["a"] == 8
    req.append_output_token_ids(8)
    assert compute(mgr, req, 1) == []  # inside block 1: nothing to do
    req.append_output_token_ids(9)
    assert compute(mgr, req, 1) == [2]  # token 8 starts block 2; block 1 registered
    assert mgr.statistics().num_cached_blocks == (2 if prefix_caching else 0)
    assert mgr.decode_limits["a"] == 12
    mgr.free(req)
    assert mgr.decode_limits == {}
    assert_pool_clean(mgr)


def test_below_the_decode_limit_allocate_slots_changes_nothing() -> None:
    """Below the limit, the general path would take no block and register none:
    the fast path (skipping it) and the general path agree at every step."""
    fast = KVCacheManager(num_blocks=16, block_size=BS)
    slow = KVCacheManager(num_blocks=16, block_size=BS)
    reqs = {m: make_request("a", list(range(1, 4))) for m in (fast, slow)}
    for mgr, req in reqs.items():
        compute(mgr, req, 3)
    for tok in range(10, 30):
        below = reqs[fast].num_computed_tokens < fast.decode_limits["a"]
        results = []
        for mgr, req in reqs.items():
            req.append_output_token_ids(tok)
            if mgr is slow:
                mgr.decode_limits.clear()  # force the general path
            results.append(compute(mgr, req, 1))
        assert results[0] == results[1]
        if below:
            assert results[0] == []
        assert [b.block_hash for b in fast.block_pool.blocks] == [
            b.block_hash for b in slow.block_pool.blocks
        ]
        assert fast.get_block_ids("a") == slow.get_block_ids("a")


def test_decode_limit_after_prefix_hits() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(1, 10)))  # 9 tokens: 2 full blocks
    compute(mgr, a, 9)
    a.append_output_token_ids(10)
    compute(mgr, a, 1)  # registers blocks 0 and 1
    b = make_request("b", list(range(1, 10)))
    hit_ids, num_computed = mgr.get_computed_blocks(b)
    assert (hit_ids, num_computed) == ([0, 1], 8)
    assert mgr.decode_limits["b"] == 8  # no block of its own yet: the next call allocates
    b.num_computed_tokens = num_computed
    assert mgr.allocate_slots(b, 1) is not None
    assert mgr.decode_limits["b"] == 12
    mgr.free(a)
    mgr.free(b)
    assert_pool_clean(mgr)
