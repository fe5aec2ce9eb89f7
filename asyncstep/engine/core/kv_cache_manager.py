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

A manager over KV cache groups (a model with sliding-window layers) is
:mod:`asyncstep.engine.core.hybrid_kv_cache_manager`'s.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from asyncstep.engine.core.request import Request
from asyncstep.kv_cache_interface import NULL_BLOCK_ID

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
