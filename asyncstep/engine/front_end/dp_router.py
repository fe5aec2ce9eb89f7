"""The data-parallel router: which replica (engine core) a request goes to
(``--data-parallel-routing``; :class:`~asyncstep.engine.front_end.data_parallel.DataParallelEngine`
asks it once per request).

A replica's *load* is ``waiting * 4 + running`` (vLLM's DP load balancer's
score): its requests in flight, those the core reports running counted
once, the rest four times. The policies:

* ``round-robin``: the live replicas in turn.
* ``load``: the least loaded live replica (ties: the lowest index).
* ``prefix`` (SGLang's cache-aware routing, simplified): the prompt's full
  blocks are hashed as the prefix cache hashes them (``block_size`` tokens,
  chained sha256: :func:`~asyncstep.engine.core.kv_cache_manager.hash_block_tokens`),
  and each replica keeps an approximate record of the block hashes routed
  to it (the most recent ``capacity`` blocks, least recently routed
  evicted; not told when its cache evicts, hence approximate). The request
  goes to the live replica whose record holds its longest run of leading
  blocks (ties: the less loaded, then the lowest index), **unless** that
  run is empty or that replica's load exceeds the least loaded live
  replica's by more than ``balance_threshold``: then it goes to the least
  loaded one. Either way its blocks are recorded for the replica chosen.

Pure bookkeeping: no I/O, no clock; imports the prefix cache's block hash only.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncstep.engine.core.kv_cache_manager import BlockHash, hash_block_tokens

#: A waiting request weighs this many running ones in a replica's load.
WAITING_WEIGHT = 4
#: Block hashes remembered per replica by default (the prefix policy).
DEFAULT_CAPACITY_BLOCKS = 1 << 16


def replica_load(num_waiting: int, num_running: int) -> int:
    """A replica's load: ``waiting * 4 + running``."""
    return num_waiting * WAITING_WEIGHT + num_running


def prompt_block_hashes(prompt: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks (the prefix cache's)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, prompt[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class PrefixRecord:
    """The block hashes routed to one replica, least recently routed first."""

    capacity: int = DEFAULT_CAPACITY_BLOCKS
    _hashes: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)

    def matched(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``' leading blocks are recorded."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._hashes)


class DataParallelRouter:
    """Picks a replica per request (see the module doc)."""

    def __init__(
        self,
        num_replicas: int,
        policy: str = "prefix",
        *,
        block_size: int = 16,
        balance_threshold: int = 32,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in ("prefix", "load", "round-robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.num_replicas = num_replicas
        self.policy = policy
        self.block_size = block_size
        self.balance_threshold = balance_threshold
        self.records = [PrefixRecord(capacity_blocks) for _ in range(num_replicas)]
        self._turn = itertools.count()

    def route(self, prompt: Sequence[int], loads: Sequence[int], alive: Sequence[bool]) -> int:
        """The replica for a request of ``prompt`` given each replica's load
        and whether it is alive (ValueError when none is)."""
        live = [i for i in range(self.num_replicas) if alive[i]]
        if not live:
            raise ValueError("no data-parallel replica is alive")
        if self.policy == "round-robin":
            return self._round_robin(live)
        least = min(live, key=lambda i: (loads[i], i))
        if self.policy == "load":
            return least
        hashes = prompt_block_hashes(prompt, self.block_size)
        matched = {i: self.records[i].matched(hashes) for i in live}
        best = min(live, key=lambda i: (-matched[i], loads[i], i))
        busy = loads[best] > loads[least] + self.balance_threshold
        chosen = least if matched[best] == 0 or busy else best
        self.records[chosen].add(hashes)
        return chosen

    def _round_robin(self, live: list[int]) -> int:
        for _ in range(self.num_replicas):
            index = next(self._turn) % self.num_replicas
            if index in live:
                return index
        return live[0]
