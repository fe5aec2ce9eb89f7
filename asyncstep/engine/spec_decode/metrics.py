"""Speculative decoding's counters (vLLM's ``SpecDecodingStats``): drafts
proposed and verified, draft tokens, accepted tokens, and acceptances per
draft position. The scheduler counts every verified draft once its step's
output is back. Pure Python; may import only the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpecDecodingStats"]


@dataclass(slots=True)
class SpecDecodingStats:
    """Totals since the engine started.

    ``num_drafts``: request-steps verified with at least one draft token;
    ``num_draft_tokens``: their draft tokens; ``num_accepted_tokens``: the
    drafts the target model accepted (the token it sampled after them is
    not counted); ``num_accepted_tokens_per_pos[i]``: drafts whose position
    ``i`` (0-based) was accepted, so entry ``i`` over ``num_drafts`` is the
    acceptance rate of position ``i`` (drafts shorter than ``i + 1`` count
    as not accepted there).
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's verified draft: its length and how many were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
