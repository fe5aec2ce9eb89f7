"""The paged KV cache's bookkeeping: which blocks each request holds.

Holds :class:`BlockPool` (blocks, reference counts, the LRU free queue, the
prefix-cache hash table), :class:`KVCacheManager` (per-request block tables,
allocation, automatic prefix caching), :class:`KVCacheStats` and
:func:`hash_block_tokens` -- the ideas of vLLM v1's ``BlockPool`` and
``KVCacheManager``. Pure Python; may import only the standard library, msgspec
and ``asyncstep.datatypes`` / ``asyncstep.config`` / ``asyncstep.errors`` /
``asyncstep.kv_cache_interface`` (plus the sibling
:mod:`asyncstep.engine.core.request`).

Conventions:

* Block ids are ``0 .. num_blocks - 1``; no null block is reserved (the runner
  pads block tables with -1), unless a KV cache group has a sliding window:
  then block 0 is the null block (:data:`~asyncstep.kv_cache_interface.NULL_BLOCK_ID`).
* A block with reference count 0 sits in the free queue, least recently used
  first. A request's blocks are freed last block first, so the tail of a
  sequence (least likely to be shared) is evicted before its prefix.
* Prefix caching: a FULL block is identified by ``sha256(parent hash, its
  token ids)``, chained from the first block. A block's hash is registered once
  the tokens in it are computed, i.e. when ``request.num_computed_tokens`` (as
  advanced by the scheduler after the step that computed them) covers it;
  :meth:`KVCacheManager.allocate_slots` and :meth:`KVCacheManager.free` do
  that. A freed block keeps its hash (a later request may still hit it) until it
  is evicted: taken from the head of the free queue for a new allocation.
* :attr:`KVCacheManager.decode_limits`: below a request's limit,
  ``allocate_slots(request, 1)`` has nothing to do (no block to take, none to
  register), so the scheduler's decode fast path skips the call.

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

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from asyncstep.engine.core.request import Request
from asyncstep.kv_cache_interface import NULL_BLOCK_ID, KVCacheGroupSpec

#: A full block's identity: a sha256 digest chained over the previous block's.
BlockHash = bytes

_ROOT_HASH: BlockHash = hashlib.sha256(b"asyncstep-prefix-cache-root").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: its tokens, chained on the previous block's hash."""
    parent = _ROOT_HASH if parent_hash is None else parent_hash
    return hashlib.sha256(parent + _pack_tokens(token_ids)).digest()


@functools.cache
def _tokens_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"{num_tokens}q")


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """The tokens as native int64s: ``array("q", token_ids).tobytes()``, faster."""
    return _tokens_struct(len(token_ids)).pack(*token_ids)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class KVBlock:
    """One block of the paged cache: its id, reference count and prefix hash."""

    block_id: int
    ref_cnt: int = 0
    #: Set while the block's (full, computed) contents are in the hash table.
    block_hash: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the cache; prefix-cache queries and hits count tokens."""

    num_blocks: int
    num_free_blocks: int
    #: Blocks whose contents are registered for prefix caching (in use or free).
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class BlockPool:
    """All blocks, their reference counts, the free queue and the hash table.
    ``reserve_null``: block 0 is the null block, never in the free queue."""

    def __init__(self, num_blocks: int, reserve_null: bool = False) -> None:
        if num_blocks <= int(reserve_null):
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        #: The null block (with ``reserve_null``): named for freed blocks.
        self.null_block: KVBlock | None = self.blocks[NULL_BLOCK_ID] if reserve_null else None
        # Blocks with ref_cnt 0, least recently used first (O(1) removal by id).
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null_block
        )
        # hash -> the blocks holding those contents (two requests may have
        # computed the same block before either was registered).
        self._cached: dict[BlockHash, dict[int, KVBlock]] = {}
        self._num_cached_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached_blocks

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (the first is evicted next)."""
        return list(self._free)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (evicting their hashes)."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot take {num_blocks} blocks; {len(self._free)} are free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        holders = self._cached.get(block_hash)
        return next(iter(holders.values())) if holders else None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block's contents for prefix caching."""
        if block.block_hash is not None:
            return  # already registered (a prefix-cache hit, or seen before)
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, {})[block.block_id] = block
        self._num_cached_blocks += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (out of the free queue if it was there)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in order; a block at 0 joins the queue's tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        holders = self._cached[block.block_hash]
        del holders[block.block_id]
        if not holders:
            del self._cached[block.block_hash]
        block.block_hash = None
        self._num_cached_blocks -= 1


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool`, with automatic prefix caching."""

    #: Whether block 0 is the null block (a windowed group names it for freed blocks).
    reserves_null_block = False

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, reserve_null=self.reserves_null_block)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # request id -> how many of its leading blocks are registered in the hash table.
        self._num_cached: dict[str, int] = {}
        #: request id -> the ``num_computed_tokens`` below which
        #: ``allocate_slots(request, 1)`` has nothing to do: the next token's
        #: slot is in a block the request holds, and no block it holds can have
        #: become full since its hashes were last registered. Read-only outside
        #: this class (the scheduler's decode fast path skips the call then).
        self.decode_limits: dict[str, int] = {}
        self._queries = 0
        self._hits = 0

    # -- queries -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_groups(self) -> int:
        """KV cache groups (the block ids' interleaving)."""
        return 1

    @property
    def token_capacity(self) -> int:
        """Tokens one request can hold at most (every block of the cache)."""
        return self.num_blocks * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (over every group)."""
        return len(self._req_blocks.get(request_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def statistics(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=self.block_pool.num_cached_blocks,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    # -- allocation ----------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Take the longest run of cached full blocks matching a new or resumed request.

        The request must hold no blocks. The hits become its first blocks (one
        more reference each); at least its last token is left to compute, so
        the model yields logits. Returns the block ids and the number of tokens
        they hold (a multiple of ``block_size``); call :meth:`free` to undo.
        No hits for a request that asks for prompt log-probs: it computes its
        whole prompt (vLLM skips the prefix cache for it too).
        """
        if request.request_id in self._req_blocks:
            raise RuntimeError(f"request {request.request_id!r} already holds blocks")
        hits: list[KVBlock] = []
        if self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None:
            hashes = self._update_block_hashes(request)
            max_hit_blocks = (request.num_tokens - 1) // self.block_size
            for block_hash in hashes[:max_hit_blocks]:
                block = self.block_pool.get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)
            self.block_pool.touch(hits)
            self._queries += request.num_tokens
            self._hits += len(hits) * self.block_size
        self._req_blocks[request.request_id] = hits
        self._num_cached[request.request_id] = len(hits)
        self._set_decode_limit(request.request_id, hits)
        return [b.block_id for b in hits], len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``request.num_computed_tokens + num_new_tokens`` tokens.

        Returns the ids of the blocks appended (maybe none), or None, taking
        nothing, when too few blocks are free. Also registers the hashes of the
        blocks that ``request.num_computed_tokens`` now fills.
        """
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        if num_new_tokens == 1 and num_computed < self.decode_limits.get(request_id, 0):
            return []  # a decode inside its last block: nothing to register or take
        blocks = self._req_blocks.get(request_id)
        if blocks is None:
            blocks = self._req_blocks[request_id] = []
            self._num_cached[request_id] = 0
        if self.enable_prefix_caching:
            self._cache_computed_blocks(request, blocks)
        num_missing = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks)
        new_block_ids: list[int] | None
        if num_missing <= 0:
            new_block_ids = []
        elif num_missing > self.block_pool.num_free_blocks:
            new_block_ids = None
        else:
            new_blocks = self.block_pool.get_new_blocks(num_missing)
            blocks.extend(new_blocks)
            new_block_ids = [b.block_id for b in new_blocks]
        self._set_decode_limit(request_id, blocks)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Drop the request's references (its computed full blocks stay cached)."""
        blocks = self._req_blocks.pop(request.request_id, None)
        if blocks is None:
            return
        self._cache_computed_blocks(request, blocks)
        self._num_cached.pop(request.request_id, None)
        self.decode_limits.pop(request.request_id, None)
        # Last block first: the tail of a sequence is evicted before its prefix.
        self.block_pool.free_blocks(reversed(blocks))

    def _set_decode_limit(self, request_id: str, blocks: list[KVBlock]) -> None:
        """Refresh :attr:`decode_limits` after the request's blocks or registrations changed."""
        limit = len(blocks) * self.block_size
        if self.enable_prefix_caching:
            # Below this no further block is full, so there is nothing to register.
            limit = min(limit, (self._num_cached[request_id] + 1) * self.block_size)
        self.decode_limits[request_id] = limit

    # -- prefix caching ------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to every full block of its tokens."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), request.num_tokens // size):
            parent = hash_block_tokens(parent, tokens[i * size : (i + 1) * size])
            hashes.append(parent)
        return hashes

    def _cache_computed_blocks(self, request: Request, blocks: list[KVBlock]) -> None:
        if not self.enable_prefix_caching:
            return
        # Placeholder tokens (async scheduling) have no ids yet: hash known tokens only.
        num_known = request.num_computed_tokens
        if num_known > request.num_tokens:
            num_known = request.num_tokens
        num_full = num_known // self.block_size
        if num_full > len(blocks):
            num_full = len(blocks)
        request_id = request.request_id
        start = self._num_cached[request_id]
        if num_full <= start:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full:
            hashes = self._update_block_hashes(request)
        cache_block = self.block_pool.cache_block
        for i in range(start, num_full):
            cache_block(blocks[i], hashes[i])
        self._num_cached[request_id] = num_full


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
