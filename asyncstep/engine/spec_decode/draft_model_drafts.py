"""The draft model's proposals as the scheduler keeps them (vLLM's
``update_draft_token_ids``): the runner runs the draft model after each
step's sampling and returns each request's draft tokens with the step's
output (``ModelRunnerOutput.draft_token_ids``); :class:`DraftModelDrafts`
holds them until the request's next step is scheduled.

A request's drafts are valid for the sequence the runner saw: they are kept
with its token count then, and dropped when the request's known tokens are
not that many (tokens were appended since, or a stop string cut them).
Pure Python; may import only ``asyncstep.config``.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncstep.config import SpeculativeConfig

__all__ = ["DraftModelDrafts"]


class DraftModelDrafts:
    """The proposer the scheduler asks for a ``draft_model`` speculation
    (the same calls as :class:`~asyncstep.engine.spec_decode.ngram_proposer.NgramProposer`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        #: Slots past a step's tokens that the draft model writes its
        #: proposals' keys and values to (the scheduler allocates them).
        self.num_lookahead_tokens = config.num_speculative_tokens
        #: Request id -> (its token count the drafts follow, the drafts).
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def update(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """The runner proposed ``drafts`` to follow the request's first
        ``num_tokens`` tokens."""
        self._drafts[request_id] = (num_tokens, drafts)

    def propose(
        self, request_id: str, token_ids: Sequence[int], max_num_draft_tokens: int
    ) -> list[int]:
        """The request's kept drafts (at most ``max_num_draft_tokens``) if
        they follow exactly ``token_ids``, else none; either way they are
        used up."""
        num_tokens, drafts = self._drafts.pop(request_id, (-1, []))
        if num_tokens != len(token_ids) or max_num_draft_tokens <= 0:
            return []
        return drafts[:max_num_draft_tokens]

    def may_propose(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Whether the request should wait for its step in flight: that
        step's output brings its drafts (the runner proposes after every
        step of a request that speculates)."""
        return True

    def forget(self, request_id: str) -> None:
        """The request ended: drop its drafts."""
        self._drafts.pop(request_id, None)
