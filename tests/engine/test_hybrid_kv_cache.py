"""The KV cache manager over KV cache groups: the groups of a layer pattern,
a windowed group's blocks freed as its requests advance, prefix caching per
group, and everything back in the pool after a free (preemption)."""

from __future__ import annotations

from asyncstep.datatypes import SamplingParams
from asyncstep.engine.core.hybrid_kv_cache_manager import (
    HybridKVCacheManager,
    make_kv_cache_manager,
)
from asyncstep.engine.core.kv_cache_manager import KVCacheManager
from asyncstep.engine.core.request import Request
from asyncstep.kv_cache_interface import NULL_BLOCK_ID, KVCacheGroupSpec, kv_cache_groups

BS = 4
W = 6


def make_request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=64), eos_token_ids={0})


def compute(mgr: KVCacheManager, request: Request, num_tokens: int) -> list[int] | None:
    new = mgr.allocate_slots(request, num_tokens)
    if new is not None:
        request.num_computed_tokens += num_tokens
    return new


def decode(mgr: KVCacheManager, request: Request, steps: int) -> None:
    for i in range(steps):
        assert compute(mgr, request, 1) is not None
        request.append_output_token_ids(100 + i)


def per_group(mgr: KVCacheManager, req_id: str) -> list[list[int]]:
    ids, k = mgr.get_block_ids(req_id), mgr.num_groups
    return [ids[g::k] for g in range(k)]


def assert_all_free(mgr: KVCacheManager) -> None:
    assert mgr.num_free_blocks == mgr.num_blocks - 1  # all but the null block
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)


def test_groups_of_layer_patterns() -> None:
    assert kv_cache_groups((None,) * 4) == (KVCacheGroupSpec((0, 1, 2, 3)),)
    assert kv_cache_groups((8,) * 3) == (KVCacheGroupSpec((0, 1, 2), 8),)
    gemma = tuple(None if i % 6 == 5 else 1024 for i in range(12))  # 5 sliding : 1 full
    groups = kv_cache_groups(gemma)
    assert [g.layer_ids for g in groups] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert [g.sliding_window for g in groups] == [None] + [1024] * 5
    assert isinstance(make_kv_cache_manager(8, BS, True, groups[:1]), KVCacheManager)
    assert isinstance(make_kv_cache_manager(8, BS, True, groups), HybridKVCacheManager)


def test_windowed_group_frees_blocks_before_its_window() -> None:
    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), W))
    mgr = make_kv_cache_manager(64, BS, False, groups)
    req = make_request("a", list(range(1, 11)))  # 10 tokens
    assert len(compute(mgr, req, 10) or []) == 3 * 2  # 3 blocks in each group, interleaved
    decode(mgr, req, 30)  # 40 tokens: 10 blocks of the full group
    full, window = per_group(mgr, "a")
    assert NULL_BLOCK_ID not in full and len(full) == 10
    # The next query (position 40) sees keys 35..40: blocks 8.. are needed;
    # freed at the last allocation (position 36 needs keys 31..: from block 7).
    assert window[:7] == [NULL_BLOCK_ID] * 7 and NULL_BLOCK_ID not in window[7:]
    assert mgr.num_held_blocks("a") == 10 + 3
    assert mgr.num_free_blocks == 63 - 13
    mgr.free(req)
    assert_all_free(mgr)


def test_off_by_one_of_the_window() -> None:
    """A query at p sees p - W + 1 .. p: with W = 5 and blocks of 4, the
    query at 8 needs key 4 (block 1), the query at 9 does not."""
    mgr = make_kv_cache_manager(16, BS, False, (KVCacheGroupSpec((0,), 5),))
    req = make_request("a", list(range(1, 9)))  # positions 0..7
    compute(mgr, req, 8)
    req.append_output_token_ids(9)
    compute(mgr, req, 1)  # the query at 8: blocks 0 (keys 0..3) goes
    assert per_group(mgr, "a")[0][:2][0] == NULL_BLOCK_ID
    assert per_group(mgr, "a")[0][1] != NULL_BLOCK_ID
    req.append_output_token_ids(10)
    compute(mgr, req, 1)  # the query at 9: (no allocation needed, no work)
    decode(mgr, req, 3)  # the query at 12 allocates block 3 and frees block 1
    assert per_group(mgr, "a")[0][:2] == [NULL_BLOCK_ID] * 2


def test_prefix_hits_need_the_window_blocks_of_each_group() -> None:
    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), W))
    mgr = make_kv_cache_manager(64, BS, True, groups)
    prompt = list(range(1, 25))  # 24 tokens, 6 blocks
    first = make_request("a", prompt)
    mgr.get_computed_blocks(first)
    compute(mgr, first, 24)
    first.append_output_token_ids(99)
    compute(mgr, first, 1)  # registers all 6 blocks, frees window blocks 0..3
    mgr.free(first)
    second = make_request("b", [*prompt, 7])
    ids, num_hit = mgr.get_computed_blocks(second)
    # Hit 6 blocks: the query at 24 sees keys 19..24: window blocks 4, 5 are
    # cached (freed blocks 0..3 stayed cached too, but are not needed).
    assert num_hit == 24
    full, window = ids[0::2], ids[1::2]
    assert NULL_BLOCK_ID not in full and window[:4] == [NULL_BLOCK_ID] * 4
    assert mgr.num_held_blocks("b") == 6 + 2
    mgr.free(second)
    assert_all_free(mgr)


def test_an_evicted_window_block_shortens_the_hit() -> None:
    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), W))
    mgr = make_kv_cache_manager(64, BS, True, groups)
    prompt = list(range(1, 25))
    first = make_request("a", prompt)
    compute(mgr, first, 24)
    first_window = per_group(mgr, "a")[1]
    mgr.free(first)
    window_block_5 = per_group_ids_after_hit(mgr, prompt)[1][5]
    assert window_block_5 == first_window[5]
    pool = mgr.block_pool
    pool._evict(pool.blocks[window_block_5])  # as if reused by another request
    second = make_request("b", [*prompt, 7])
    ids, num_hit = mgr.get_computed_blocks(second)
    # 6 blocks would need window block 5; 5 blocks need window blocks 3, 4.
    assert num_hit == 5 * BS
    assert ids[1::2] == [NULL_BLOCK_ID] * 3 + first_window[3:5]
    mgr.free(second)
    assert_all_free(mgr)


def per_group_ids_after_hit(mgr: KVCacheManager, prompt: list[int]) -> list[list[int]]:
    """The groups' cached blocks of ``prompt`` (taken and given back)."""
    probe = make_request("probe", [*prompt, 7])
    ids, _ = mgr.get_computed_blocks(probe)
    mgr.free(probe)
    return [ids[0::2], ids[1::2]]


def test_no_room_takes_nothing_and_free_returns_every_block() -> None:
    groups = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), W))
    mgr = make_kv_cache_manager(9, BS, True, groups)  # 8 usable blocks
    assert mgr.token_capacity == 4 * BS
    req = make_request("a", list(range(1, 13)))
    assert compute(mgr, req, 12) is not None  # 3 + 3 blocks
    other = make_request("b", list(range(50, 58)))
    assert mgr.allocate_slots(other, 8) is None  # 2 + 2 > 2 free
    assert mgr.num_free_blocks == 2
    mgr.free(other)
    mgr.free(req)  # preemption: all back
    assert_all_free(mgr)
