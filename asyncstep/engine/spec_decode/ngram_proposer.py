"""The n-gram draft proposer (prompt lookup; vLLM's ``ngram`` method): the
draft tokens of a request are what followed, earlier in its own sequence
(prompt and output), the n-gram it ends with.

:func:`propose_ngram` is the whole method: no model, no state.
:class:`NgramProposer` runs it in the engine core, where the scheduler keeps
every request's token ids, once per decode step of a request that
speculates (each request's tokens mirrored in an array that grows with it).
Pure numpy; may import only numpy and ``asyncstep.config``.
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
    earliest (the most tokens after it). Empty when no n-gram of at least
    ``min_n`` tokens recurs, or ``num_draft_tokens`` is 0. Costs
    ``O(len(token_ids) * max_n)`` at worst, usually ``O(len)``."""
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
    """:func:`propose_ngram` with a :class:`SpeculativeConfig`'s settings,
    over each request's tokens kept as an int64 array that grows with the
    request (a step converts only its new tokens); :meth:`forget` a request
    when it ends (its id may come back with other tokens)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens
        #: No slots past a step's tokens: the drafts are proposed on the host.
        self.num_lookahead_tokens = 0
        #: Request id -> (a buffer holding its tokens, how many it holds).
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def propose(
        self, request_id: str, token_ids: Sequence[int], max_num_draft_tokens: int
    ) -> list[int]:
        """At most ``min(num_speculative_tokens, max_num_draft_tokens)``
        draft tokens to follow ``token_ids``, the request's tokens (which
        only grow while it lives), maybe none."""
        k = min(self.num_speculative_tokens, max_num_draft_tokens)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        ids = self._token_array(request_id, token_ids)
        drafts: list[int] = propose_ngram(ids, self.min_n, self.max_n, k).tolist()
        return drafts

    def may_propose(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Whether :meth:`propose` finds drafts after ``token_ids``."""
        return bool(self.propose(request_id, token_ids, 1))

    def forget(self, request_id: str) -> None:
        """The request ended: drop its array."""
        self._arrays.pop(request_id, None)

    def _token_array(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        """``token_ids`` as an int64 array, converting only the tokens added
        since the last call for the request."""
        num_tokens = len(token_ids)
        buffer, filled = self._arrays.get(request_id, (_NO_DRAFT, 0))
        if filled > num_tokens or (
            filled and (buffer[0] != token_ids[0] or buffer[filled - 1] != token_ids[filled - 1])
        ):
            filled = 0  # not the tokens it was (an id used again): start over
        if num_tokens > len(buffer):
            grown = np.empty(max(2 * num_tokens, 64), dtype=np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        if num_tokens > filled:
            buffer[filled:num_tokens] = token_ids[filled:num_tokens]
        self._arrays[request_id] = (buffer, num_tokens)
        return buffer[:num_tokens]
