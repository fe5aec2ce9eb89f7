"""The KV cache manager over KV cache groups: :class:`HybridKVCacheManager`
(vLLM v1's name) and :func:`make_kv_cache_manager`, which picks it or the
plain :class:`~asyncstep.engine.core.kv_cache_manager.KVCacheManager` for a
model's groups. Pure Python; may import only the standard library,
``asyncstep.kv_cache_interface`` and its siblings
:mod:`asyncstep.engine.core.kv_cache_manager` (the block pool, the plain
manager it extends) and :mod:`asyncstep.engine.core.request`.

KV cache groups (:mod:`asyncstep.kv_cache_interface`; one full-attention
group unless given): every group holds its own blocks for each request, one
per ``block_size`` tokens, from the one pool; the ids the manager returns are
the groups' interleaved (entry ``i * num_groups + g``). A windowed group's
blocks wholly before the window of the request's next query (blocks ``<
(num_computed_tokens - W + 1) // block_size``) go back to the pool at the
request's next ``allocate_slots`` call that does work (at least once per
block of tokens), replaced by the null block. Prefix caching per group (a
block's hash is registered in each group under the group's own key): a hit
of ``h`` blocks needs every full-attention group's first ``h`` blocks and
each windowed group's blocks from the one the window of token ``h *
block_size`` starts in; the longest ``h`` all groups have is taken.
"""

from __future__ import annotations

from asyncstep.engine.core.kv_cache_manager import BlockHash, KVBlock, KVCacheManager
from asyncstep.engine.core.request import Request
from asyncstep.kv_cache_interface import NULL_BLOCK_ID, KVCacheGroupSpec


class HybridKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` over several KV cache groups, or one windowed
    group (the module's "KV cache groups"); the block ids it takes and
    returns are the groups' interleaved."""

    reserves_null_block = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        groups: tuple[KVCacheGroupSpec, ...],
    ) -> None:
        if not groups:
            raise ValueError("a hybrid KV cache manager needs its groups")
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.groups = groups
        self.windows = [g.sliding_window for g in groups]
        self._null = self.block_pool.blocks[NULL_BLOCK_ID]
        #: request id -> each group's blocks (the null block where freed).
        self._group_blocks: dict[str, list[list[KVBlock]]] = {}
        #: request id -> each group's leading blocks already freed (or skipped).
        self._num_freed: dict[str, list[int]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def token_capacity(self) -> int:
        return (self.num_blocks - 1) // self.num_groups * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        per_group = self._group_blocks.get(request_id)
        if not per_group:
            return []
        return [b.block_id for row in zip(*per_group, strict=True) for b in row]

    def num_held_blocks(self, request_id: str) -> int:
        null = self._null
        return sum(
            b is not null for blocks in self._group_blocks.get(request_id, ()) for b in blocks
        )

    # -- allocation ----------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        request_id = request.request_id
        if request_id in self._group_blocks:
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        per_group: list[list[KVBlock]] = [[] for _ in self.groups]
        firsts = [0] * self.num_groups
        num_hit = 0
        if self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
            hashes = self._update_block_hashes(request)
            num_hit = self._longest_hit(hashes[: (request.num_tokens - 1) // self.block_size])
            get = self.block_pool.get_cached_block
            for g, window in enumerate(self.windows):
                first = firsts[g] = self._first_needed_block(num_hit * self.block_size, window)
                hits = [get(_group_key(hashes[i], g)) for i in range(first, num_hit)]
                assert all(hits), "a hit found by _longest_hit must be there"
                self.block_pool.touch(hits)  # type: ignore[arg-type]
                per_group[g] = [self._null] * first + hits  # type: ignore[operator]
            self._queries += request.num_tokens
            self._hits += num_hit * self.block_size
        self._group_blocks[request_id] = per_group
        self._num_freed[request_id] = firsts
        self._num_cached[request_id] = num_hit
        self._set_group_decode_limit(request_id, num_hit)
        return self.get_block_ids(request_id), num_hit * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        if num_new_tokens == 1 and num_computed < self.decode_limits.get(request_id, 0):
            return []
        per_group = self._group_blocks.get(request_id)
        if per_group is None:
            per_group = self._group_blocks[request_id] = [[] for _ in self.groups]
            self._num_freed[request_id] = [0] * self.num_groups
            self._num_cached[request_id] = 0
        if self.enable_prefix_caching:
            self._cache_group_blocks(request, per_group)
        self._free_skipped_blocks(request_id, per_group, num_computed)
        num_logical = len(per_group[0])
        num_missing = -(-(num_computed + num_new_tokens) // self.block_size) - num_logical
        new_block_ids: list[int] | None = []
        if num_missing * self.num_groups > self.block_pool.num_free_blocks:
            new_block_ids = None
        elif num_missing > 0:
            taken = self.block_pool.get_new_blocks(num_missing * self.num_groups)
            for g, blocks in enumerate(per_group):
                blocks.extend(taken[g * num_missing : (g + 1) * num_missing])
            new_block_ids = [
                taken[g * num_missing + i].block_id
                for i in range(num_missing)
                for g in range(self.num_groups)
            ]
        self._set_group_decode_limit(request_id, len(per_group[0]))
        return new_block_ids

    def free(self, request: Request) -> None:
        per_group = self._group_blocks.pop(request.request_id, None)
        if per_group is None:
            return
        if self.enable_prefix_caching:
            self._cache_group_blocks(request, per_group)
        self._num_cached.pop(request.request_id, None)
        self._num_freed.pop(request.request_id, None)
        self.decode_limits.pop(request.request_id, None)
        null = self._null
        for blocks in per_group:  # each group's tail first
            self.block_pool.free_blocks(b for b in reversed(blocks) if b is not null)

    def _first_needed_block(self, num_computed: int, window: int | None) -> int:
        """The first block the query at position ``num_computed`` reads."""
        if window is None:
            return 0
        return max(num_computed - window + 1, 0) // self.block_size

    def _free_skipped_blocks(
        self, request_id: str, per_group: list[list[KVBlock]], num_computed: int
    ) -> None:
        """Free each windowed group's blocks before its next query's window."""
        freed = self._num_freed[request_id]
        null = self._null
        for g, window in enumerate(self.windows):
            first = min(self._first_needed_block(num_computed, window), len(per_group[g]))
            if first <= freed[g]:
                continue
            blocks = per_group[g]
            leaving = [b for b in blocks[freed[g] : first] if b is not null]
            blocks[freed[g] : first] = [null] * (first - freed[g])
            freed[g] = first
            self.block_pool.free_blocks(reversed(leaving))

    def _set_group_decode_limit(self, request_id: str, num_logical: int) -> None:
        limit = num_logical * self.block_size
        if self.enable_prefix_caching:
            limit = min(limit, (self._num_cached[request_id] + 1) * self.block_size)
        self.decode_limits[request_id] = limit

    # -- prefix caching ------------------------------------------------------

    def _longest_hit(self, hashes: list[BlockHash]) -> int:
        """The most leading blocks every group has cached (the module's rule)."""
        get = self.block_pool.get_cached_block
        limit = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                hit = 0
                while hit < limit and get(_group_key(hashes[hit], g)) is not None:
                    hit += 1
                limit = hit
        windowed = [g for g, w in enumerate(self.windows) if w is not None]
        runs = {}  # group -> consecutive cached blocks ending at each block
        for g in windowed:
            run, ends = 0, []
            for i in range(limit):
                run = run + 1 if get(_group_key(hashes[i], g)) is not None else 0
                ends.append(run)
            runs[g] = ends
        settled = False
        while not settled and limit > 0:
            settled = True
            for g in windowed:
                while limit > 0:
                    first = self._first_needed_block(limit * self.block_size, self.windows[g])
                    if runs[g][limit - 1] >= limit - first:
                        break
                    limit -= 1
                    settled = False
        return limit

    def _cache_group_blocks(self, request: Request, per_group: list[list[KVBlock]]) -> None:
        """Register the blocks ``request.num_computed_tokens`` has filled, in each group."""
        num_known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_known // self.block_size, len(per_group[0]))
        request_id = request.request_id
        start = self._num_cached[request_id]
        if num_full <= start:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full:
            hashes = self._update_block_hashes(request)
        null, cache_block = self._null, self.block_pool.cache_block
        for g, blocks in enumerate(per_group):
            for i in range(start, num_full):
                if blocks[i] is not null:
                    cache_block(blocks[i], _group_key(hashes[i], g))
        self._num_cached[request_id] = num_full


def make_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool = True,
    groups: tuple[KVCacheGroupSpec, ...] = (),
) -> KVCacheManager:
    """The manager for ``groups``: the plain :class:`KVCacheManager` for none
    or one full-attention group, else a :class:`HybridKVCacheManager`."""
    if len(groups) <= 1 and all(g.sliding_window is None for g in groups):
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return HybridKVCacheManager(num_blocks, block_size, enable_prefix_caching, groups)


def _group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """Group ``group``'s key for a block of hash ``block_hash`` (group 0: the hash)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(4, "little")
