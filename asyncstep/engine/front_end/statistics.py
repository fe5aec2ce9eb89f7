"""The engine's counters (``Engine.statistics()``): the scheduler's as of
the core's latest message
(:class:`~asyncstep.engine.messages.core_messages.CoreStats`), and the front
end's own. Imports the core's messages only."""

from __future__ import annotations

from dataclasses import dataclass

from asyncstep.engine.messages.core_messages import CoreStats


@dataclass(frozen=True)
class EngineStatistics:
    num_running_reqs: int
    num_waiting_reqs: int
    num_steps: int
    num_preemptions: int
    num_generated_tokens: int
    num_finished_reqs: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_hit_rate: float
    #: Speculative decoding (0 and [] while off): request-steps verified with
    #: drafts, their draft tokens, the drafts accepted, and per draft position
    #: the drafts accepted there (over ``spec_decode_num_drafts``: that
    #: position's acceptance rate).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    #: A MoE model: token rows routed to each expert since the engine started
    #: (its reporting stage's MoE layers summed; () for a dense model).
    moe_expert_tokens: tuple[int, ...] = ()
    #: Prompt tokens looked up in the prefix cache, and those found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Draft tokens accepted over proposed (0 before any)."""
        drafts = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0


def engine_statistics(
    core: CoreStats, num_generated_tokens: int, num_finished: int
) -> EngineStatistics:
    """The core's counters ``core`` with the front end's: the tokens its
    requests got, and the requests that ended."""
    return EngineStatistics(
        num_running_reqs=core.num_running_reqs,
        num_waiting_reqs=core.num_waiting_reqs,
        num_steps=core.num_steps,
        num_preemptions=core.num_preemptions,
        num_generated_tokens=num_generated_tokens,
        num_finished_reqs=num_finished,
        kv_cache_usage=core.kv_cache_usage,
        num_kv_blocks=core.num_kv_blocks,
        prefix_cache_hit_rate=core.prefix_cache_hit_rate,
        spec_decode_num_drafts=core.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=core.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=core.spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=tuple(core.spec_decode_num_accepted_tokens_per_pos),
        moe_expert_tokens=tuple(core.moe_expert_tokens),
        prefix_cache_queries=core.prefix_cache_queries,
        prefix_cache_hits=core.prefix_cache_hits,
    )
