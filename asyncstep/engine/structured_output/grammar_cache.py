"""The engine core's compiled grammars kept for reuse, bounded in bytes.

A grammar is known by its :class:`GrammarKey` (its kind and text, and their
SHA-256: the key a cache and the compile queue look up; the text itself can
be a MiB). :class:`GrammarCache` keeps the most recently used compiled
grammars whose sizes (xgrammar's ``memory_size_bytes``) add up to at most
its bound; a grammar larger than the bound is not kept. A grammar in use by
a request's matcher lives as long as the matcher, whatever the cache
dropped. Imports the structured-output params only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from asyncstep.structured_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarKey:
    """A grammar: its kind and text (``StructuredOutputsParams.grammar_kind`` and ``.spec``)."""

    kind: str
    spec: str = field(repr=False)
    #: SHA-256 of kind and text: what the grammar is known by.
    digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).digest()
        object.__setattr__(self, "digest", digest)

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> GrammarKey:
        return cls(params.grammar_kind, params.spec)


@dataclass
class GrammarCacheStats:
    num_grammars: int = 0
    num_bytes: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_evicted: int = 0


class GrammarCache:
    """Compiled grammars by key, least recently used dropped first, their
    sizes adding up to at most ``max_bytes`` (0: none kept)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        #: digest -> (compiled grammar, its size), least recently used first.
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._stats = GrammarCacheStats()

    @property
    def num_bytes(self) -> int:
        return self._stats.num_bytes

    def statistics(self) -> GrammarCacheStats:
        return GrammarCacheStats(**vars(self._stats))

    def get(self, key: GrammarKey) -> Any | None:
        """The compiled grammar of ``key``, if kept (it becomes the most recent)."""
        entry = self._entries.get(key.digest)
        if entry is None:
            self._stats.num_misses += 1
            return None
        self._entries.move_to_end(key.digest)
        self._stats.num_hits += 1
        return entry[0]

    def put(self, key: GrammarKey, compiled: Any, num_bytes: int) -> None:
        """Keep ``compiled`` (``num_bytes`` large), dropping the least recently
        used until the sizes fit; not kept if it alone is over the bound."""
        old = self._entries.pop(key.digest, None)
        stats = self._stats
        if old is not None:
            stats.num_bytes -= old[1]
        if num_bytes > self.max_bytes:
            stats.num_grammars = len(self._entries)
            return
        while self._entries and stats.num_bytes + num_bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            stats.num_bytes -= dropped
            stats.num_evicted += 1
        self._entries[key.digest] = (compiled, num_bytes)
        stats.num_bytes += num_bytes
        stats.num_grammars = len(self._entries)
