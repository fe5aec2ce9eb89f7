"""The n-gram draft proposer (prompt lookup; vLLM's ``ngram`` method): the
draft tokens of a request are what followed, earlier in its own sequence
(prompt and output), the n-gram it ends with.

:func:`propose_ngram` is the whole method: no model, no state. It runs in
the engine core, where the scheduler keeps every request's token ids, once
per decode step of a request that speculates. Pure numpy; may import only
numpy and ``asyncstep.config``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asyncstep.config import SpeculativeConfig

__all__ = ["NgramProposer", "propose_ngram"]

_NO_DRAFT = np.zeros(0, dtype=np.int64)


def propose_ngram(
    token_ids: np.ndarray, min_n: int, max_n: int, num_draft_tokens: int
) -> np.ndarray:
    """Draft tokens for a sequence ``token_ids`` (1-D ints): the (up to)
    ``num_draft_tokens`` tokens that follow an earlier occurrence of its
    last ``n`` tokens, for the longest ``n`` in ``[min_n, max_n]`` that
    occurs earlier (an occurrence may overlap the suffix itself): the latest
    such occurrence followed by ``num_draft_tokens`` tokens, else the
    earliest (the most tokens after it). Empty when
    no n-gram of at least ``min_n`` tokens recurs, or ``num_draft_tokens`` is
    0. Costs ``O(len(token_ids) * max_n)`` at worst, usually ``O(len)``."""
    length = len(token_ids)
    if num_draft_tokens <= 0 or length < min_n + 1:
        return _NO_DRAFT
    # Candidate ends of an earlier occurrence: positions before the last
    # holding the last token.
    ends = np.flatnonzero(token_ids[: length - 1] == token_ids[-1])
    if ends.size == 0:
        return _NO_DRAFT
    # Extend every candidate backwards while it still matches the suffix.
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, max_n):
        alive &= ends >= back
        if not alive.any():
            break
        idx = np.flatnonzero(alive)
        same = token_ids[ends[idx] - back] == token_ids[length - 1 - back]
        alive[idx] = same
        matched[idx[same]] = back + 1
    best = int(matched.max())
    if best < min_n:
        return _NO_DRAFT
    best_ends = ends[matched == best]
    full = best_ends[best_ends + num_draft_tokens < length]
    end = int(full[-1] if full.size else best_ends[0])
    return token_ids[end + 1 : end + 1 + num_draft_tokens]


class NgramProposer:
    """:func:`propose_ngram` with a :class:`SpeculativeConfig`'s settings."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_num_draft_tokens: int) -> list[int]:
        """At most ``min(num_speculative_tokens, max_num_draft_tokens)``
        draft tokens to follow ``token_ids`` (maybe none)."""
        k = min(self.num_speculative_tokens, max_num_draft_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        drafts: list[int] = propose_ngram(ids, self.min_n, self.max_n, k).tolist()
        return drafts
