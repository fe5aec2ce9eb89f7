"""Speculative decoding's part of the scheduler: :class:`DraftScheduler`.

It owns the proposer (the n-gram proposer, or the draft model's proposals
kept by :class:`~asyncstep.engine.spec_decode.draft_model_drafts.DraftModelDrafts`),
the grammar's filter of drafts and the speculation's counters. The
scheduler asks it whether a request with tokens in flight waits to
speculate, and hands it the step's decodes once every running request has
its tokens: it gives them draft tokens (and, with a draft model, lookahead
slots) within the token budget left, only from free blocks. How drafts are
scheduled and rolled back: docs/architecture.md, "The scheduler".

Contract: drafts never preempt a request, never reach past ``max_tokens``
or ``max_seq_len``, and only a decode with no placeholder gets them; a
request's ``num_computed_tokens`` counts its drafts once they are scheduled.

Pure Python; may import only ``asyncstep.config``, its siblings ``request``,
``kv_cache_manager`` and ``step_plan``, and ``asyncstep.engine.spec_decode``.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncstep.config import SpeculativeConfig
from asyncstep.engine.core.kv_cache_manager import KVCacheManager
from asyncstep.engine.core.request import Request, RequestStatus
from asyncstep.engine.core.step_plan import StepPlan
from asyncstep.engine.spec_decode.draft_model_drafts import DraftModelDrafts
from asyncstep.engine.spec_decode.metrics import SpecDecodingStats
from asyncstep.engine.spec_decode.ngram_proposer import NgramProposer


class DraftScheduler:
    """Proposes and schedules a step's draft tokens over the scheduler's KV
    cache manager; ``max_seq_len``: the longest a sequence may grow."""

    def __init__(
        self,
        speculative_config: SpeculativeConfig,
        kv_cache_manager: KVCacheManager,
        max_seq_len: int,
    ) -> None:
        self.proposer: NgramProposer | DraftModelDrafts = (
            DraftModelDrafts(speculative_config)
            if speculative_config.method == "draft_model"
            else NgramProposer(speculative_config)
        )
        #: (request id, drafts) -> the prefix of them its grammar accepts; set
        #: by the engine core (the structured outputs' matchers), None: all.
        self.draft_filter: Callable[[str, list[int]], list[int]] | None = None
        #: No drafts while at least this many requests run (None: any number).
        self.disable_by_batch_size = speculative_config.disable_by_batch_size
        self.stats = SpecDecodingStats(speculative_config.num_speculative_tokens)
        self.kv_cache_manager = kv_cache_manager
        self.max_seq_len = max_seq_len

    def is_enabled(self, num_running: int) -> bool:
        """Whether a batch of ``num_running`` requests may verify drafts."""
        disable = self.disable_by_batch_size
        return disable is None or num_running < disable

    def waits_to_speculate(self, request: Request, num_running: int) -> bool:
        """Async scheduling: whether a request with tokens in flight should
        wait for them rather than be scheduled over placeholders: it may
        speculate, has room for drafts, and its known tokens end with an
        n-gram that recurs (the proposer would find drafts, and drafts need
        every token's id). Its verify steps then run alone in flight for it;
        the others keep overlapping."""
        if not request.speculates or request.spec_backoff:
            return False
        if not self.is_enabled(num_running):
            return False
        num_tokens = request.num_tokens + request.num_output_placeholders
        if min(request.max_num_tokens, self.max_seq_len) - num_tokens - 1 <= 0:
            return False
        return self.proposer.may_propose(request.request_id, request.all_token_ids)

    def schedule_drafts(self, candidates: list[tuple[int, Request]], plan: StepPlan) -> None:
        """Give the step's decodes their drafts, in priority order, within
        the token budget left once every running request has its tokens,
        and only from free blocks: drafts never push another request out
        (a decode without room for its drafts goes without). ``candidates``:
        (the request's index in the plan's running columns, the request),
        each already scheduled for its one token."""
        lookahead = self.proposer.num_lookahead_tokens
        for column, request in candidates:
            if plan.token_budget > 0:
                self._schedule_request_drafts(column, request, plan)
            if lookahead:
                self._allocate_lookahead(column, request, plan, lookahead)

    def keep_drafts(self, drafts: dict[str, list[int]], requests: dict[str, Request]) -> None:
        """Keep the draft model's proposals (a step's ``draft_token_ids``) of
        the requests still running, for the token count they follow; the
        n-gram proposer keeps none."""
        if not isinstance(self.proposer, DraftModelDrafts):
            return
        for req_id, tokens in drafts.items():
            request = requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.proposer.update(req_id, request.num_tokens, tokens)

    def forget(self, request_id: str) -> None:
        """Drop what the proposer keeps of a request that ended."""
        self.proposer.forget(request_id)

    def _schedule_request_drafts(self, column: int, request: Request, plan: StepPlan) -> None:
        """One candidate's drafts (see :meth:`schedule_drafts`)."""
        drafts = self._propose_drafts(request, plan.token_budget + 1)
        grammar = request.sampling_params.structured_outputs is not None
        if drafts and grammar and self.draft_filter is not None:
            drafts = self.draft_filter(request.request_id, drafts)
        if not drafts:
            return
        # The slots of 1 + drafts tokens from the count before this step
        # (so that only computed blocks are registered in the prefix cache).
        computed = request.num_computed_tokens - 1
        request.num_computed_tokens = computed
        new_block_ids = self.kv_cache_manager.allocate_slots(request, 1 + len(drafts))
        request.num_computed_tokens = computed + 1
        if new_block_ids is None:
            return
        num_drafts = len(drafts)
        request.num_computed_tokens += num_drafts
        plan.running_new_block_ids[column] = plan.running_new_block_ids[column] + new_block_ids
        plan.num_scheduled_tokens[request.request_id] += num_drafts
        plan.token_budget -= num_drafts
        plan.spec_token_ids[request.request_id] = drafts

    def _allocate_lookahead(
        self, column: int, request: Request, plan: StepPlan, lookahead: int
    ) -> None:
        """Slots for ``lookahead`` tokens past the request's tokens of this
        step, where the draft model writes its proposals' keys and values
        after the step (within the context; only from free blocks: without
        room the runner proposes fewer drafts, or none)."""
        num_new = plan.num_scheduled_tokens[request.request_id]
        computed = request.num_computed_tokens - num_new
        num_slots = min(num_new + lookahead, self.max_seq_len - computed)
        if num_slots <= num_new:
            return
        request.num_computed_tokens = computed  # (registers only computed blocks)
        new_block_ids = self.kv_cache_manager.allocate_slots(request, num_slots)
        request.num_computed_tokens = computed + num_new
        if new_block_ids:
            plan.running_new_block_ids[column] = plan.running_new_block_ids[column] + new_block_ids

    def _propose_drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decode of ``request`` within ``budget`` tokens
        (its own token included): never so many that ``1 + drafts`` sampled
        tokens would pass ``max_tokens`` or the context."""
        num_tokens = request.num_tokens
        room = min(
            budget - 1,
            request.max_num_tokens - num_tokens - 1,
            self.max_seq_len - num_tokens - 1,
        )
        if room <= 0:
            return []
        return self.proposer.propose(request.request_id, request.all_token_ids, room)
