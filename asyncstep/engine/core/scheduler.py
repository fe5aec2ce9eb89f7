"""The continuous-batching scheduler (vLLM v1's unified scheduler).

Holds :class:`Scheduler` (its queues, the scheduling policy, the requests'
lifecycle) and :class:`SchedulerStats`. A step's plan and the
``SchedulerOutput`` built from it are in :mod:`asyncstep.engine.core.step_plan`
(with the output's conventions the runner relies on); what tokens cost
against the step's budget in :mod:`asyncstep.engine.core.token_budget`; the
draft tokens of speculative decoding in
:mod:`asyncstep.engine.core.draft_scheduling`; the per-request
results of a step's output, with the stop rules, in
:mod:`asyncstep.engine.core.step_results`. How it schedules (placeholders,
pipelines, speculation, preemption): docs/architecture.md, "The scheduler".

Contract: ``schedule()`` hands each request the tokens it lacks within the
step's token budget and advances ``num_computed_tokens`` at once, so several
steps may be in flight; ``update_from_output()`` takes each step's output in
step order. A request is never scheduled past ``max_tokens`` or its context;
a finished request keeps its blocks until every step in flight that uses
them is back, and is reported in ``finished_req_ids`` only then; rejected
draft tokens are rolled back before any stop rule or free runs.

Pure Python; may import only the standard library and ``asyncstep.datatypes``
/ ``asyncstep.config`` / ``asyncstep.errors`` / ``asyncstep.kv_cache_interface``
(plus its siblings ``request``, ``kv_cache_manager``,
``hybrid_kv_cache_manager``, ``step_plan``, ``token_budget``,
``draft_scheduling`` and ``step_results``, the messages
``asyncstep.engine.messages.core_messages`` and the speculation's counters of
``asyncstep.engine.spec_decode``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from asyncstep.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from asyncstep.datatypes import ModelRunnerOutput, SchedulerOutput
from asyncstep.engine.core.draft_scheduling import DraftScheduler
from asyncstep.engine.core.hybrid_kv_cache_manager import make_kv_cache_manager
from asyncstep.engine.core.kv_cache_manager import KVCacheStats
from asyncstep.engine.core.request import Request, RequestStatus
from asyncstep.engine.core.step_plan import StepPlan
from asyncstep.engine.core.step_results import add_prompt_logprobs, collect_step_results
from asyncstep.engine.core.token_budget import (
    PROMPT_LOGPROBS_TOKEN_COST,
    budget_cost,
    num_tokens_within,
)
from asyncstep.engine.messages.core_messages import EngineCoreOutput
from asyncstep.engine.spec_decode.metrics import SpecDecodingStats
from asyncstep.errors import ConfigError, InvalidRequestError
from asyncstep.kv_cache_interface import KVCacheGroupSpec

__all__ = ["PROMPT_LOGPROBS_TOKEN_COST", "Scheduler", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues and its KV cache."""

    step_id: int
    num_running_reqs: int
    num_waiting_reqs: int
    #: Preemptions since the scheduler started.
    num_preemptions: int
    kv_cache: KVCacheStats
    #: Speculative decoding's counters (None: speculation off).
    spec_decoding: SpecDecodingStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache.usage


class Scheduler:
    """Decides every step which requests compute how many tokens.

    ``running`` is in priority order (first come, first served); the last one
    is preempted first. ``waiting`` holds new and preempted requests, preempted
    ones at the front.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        *,
        send_new_token_ids: bool = False,
        async_scheduling: bool = False,
        max_num_running_reqs: int | None = None,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
        kv_cache_groups: tuple[KVCacheGroupSpec, ...] = (),
    ) -> None:
        """``max_num_running_reqs``: requests admitted at once (default
        ``max_num_seqs``); more with a pipeline, whose steps in flight hold
        different requests. A step never holds more than ``max_num_seqs``.

        ``max_model_len``: the resolved context length
        (``config.model.max_model_len`` once the engine has resolved it);
        ConfigError unless positive. ``max_num_batched_tokens`` must be
        resolved too (ConfigError while None).

        ``speculative_config``: propose draft tokens for decodes (see the
        module doc). ``kv_cache_groups``: the model's KV cache groups
        (:func:`~asyncstep.kv_cache_interface.kv_cache_groups`; none: one
        full-attention group)."""
        if max_model_len <= 0:
            raise ConfigError(
                "max_model_len must be resolved (positive) before building the scheduler, "
                f"got {max_model_len}"
            )
        if scheduler_config.max_num_batched_tokens is None:
            raise ConfigError(
                "max_num_batched_tokens must be resolved for the device before building "
                "the scheduler"
            )
        self.scheduler_config = scheduler_config
        self.send_new_token_ids = send_new_token_ids
        self.async_scheduling = async_scheduling
        #: request id -> output tokens already sent to the ranks (new_token_ids).
        self._num_output_tokens_sent: dict[str, int] = {}
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens: int = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_running_reqs = max_num_running_reqs or self.max_num_seqs
        if self.max_num_running_reqs < self.max_num_seqs:
            raise ConfigError(
                f"max_num_running_reqs ({self.max_num_running_reqs}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.block_size = cache_config.block_size
        self.kv_cache_manager = make_kv_cache_manager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_cache_groups
        )
        #: Longest a sequence may grow: the model's context, or the whole cache.
        self.max_seq_len = min(self.max_model_len, self.kv_cache_manager.token_capacity)
        #: Speculative decoding's drafts (None: speculation off).
        self.drafts: DraftScheduler | None = None
        if speculative_config is not None:
            kv = self.kv_cache_manager
            self.drafts = DraftScheduler(speculative_config, kv, self.max_seq_len)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        #: Ended requests whose blocks wait for their steps in flight.
        self._finishing: dict[str, Request] = {}
        self.step_id = 0
        self.num_preemptions = 0

    # -- requests in and out --------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; InvalidRequestError if its prompt can never be served."""
        self._check_fits(request)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        if request.request_id in self._finishing:  # its blocks wait for steps in flight
            raise InvalidRequestError(
                f"request id {request.request_id!r} is still in use: the request that had it "
                "is finishing"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): free their blocks.

        Unknown (already finished) ids are ignored.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status.name}")
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        ended = [self.requests[i] for i in ids if i in self.requests]
        if not ended:
            return
        self._remove_from_queues({r.request_id for r in ended})
        for request in ended:
            request.status = status
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_finished_requests(self) -> bool:
        """Ended requests the next ``schedule()`` still has to report to the runner."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def has_work_to_schedule(self) -> bool:
        """Whether ``schedule()`` now has anything to do: finished requests to
        report, a running request with tokens to compute, or room to admit a
        waiting one."""
        if self.finished_req_ids:
            return True
        if self.waiting and len(self.running) < self.max_num_running_reqs:
            return True
        max_seq_len = self.max_seq_len
        for request in self.running:
            placeholders = request.num_output_placeholders
            num_tokens = request.num_tokens + placeholders
            if placeholders and (num_tokens >= request.max_num_tokens or num_tokens >= max_seq_len):
                continue
            if num_tokens > request.num_computed_tokens and not (
                placeholders and self._waits_to_speculate(request)
            ):
                return True
        return False

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            step_id=self.step_id,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_cache=self.kv_cache_manager.statistics(),
            spec_decoding=self.spec_decoding_stats,
        )

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's counters (None: speculation off)."""
        return None if self.drafts is None else self.drafts.stats

    # -- scheduling ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts (possibly none)."""
        plan = StepPlan(self.max_num_batched_tokens)
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._schedule_waiting(plan)
        unsent = self._unsent_output_tokens if self.send_new_token_ids else None
        kv, finished = self.kv_cache_manager, self.finished_req_ids
        output = plan.build_output(self.step_id, kv, finished, unsent)
        async_scheduling = self.async_scheduling
        num_scheduled = plan.num_scheduled_tokens
        for request in plan.admitted_reqs:
            request.num_computed_tokens += num_scheduled[request.request_id]
            request.num_in_flight_steps += 1
            if async_scheduling and request.num_computed_tokens >= request.num_tokens:
                request.num_output_placeholders += 1  # this step samples for it
        if self.finished_req_ids:
            self.finished_req_ids = set()
        self.step_id += 1
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        """Schedule the running requests in order, preempting from the back.

        A decode (one token to compute) whose slot is in a block the request
        holds, with no block to register, skips the allocator: the KV cache
        manager's :attr:`~KVCacheManager.decode_limits` say so.
        """
        running = self.running
        num_scheduled = plan.num_scheduled_tokens
        req_ids = plan.running_req_ids
        num_computed_col = plan.running_num_computed
        block_ids_col = plan.running_new_block_ids
        decode_limits = self.kv_cache_manager.decode_limits
        max_num_seqs = self.max_num_seqs
        max_seq_len = self.max_seq_len
        max_model_len = self.max_model_len
        async_scheduling = self.async_scheduling
        drafts = self.drafts
        if drafts is not None and not drafts.is_enabled(len(running)):
            drafts = None  # a batch this large verifies no drafts
        #: Decodes that may speculate: (their index in the plan's columns, request).
        draft_candidates: list[tuple[int, Request]] = []
        budget = plan.token_budget
        index = 0
        while index < len(running) and budget > 0 and len(num_scheduled) < max_num_seqs:
            request = running[index]
            index += 1
            num_computed = request.num_computed_tokens
            num_tokens = request.num_tokens
            placeholders = request.num_output_placeholders
            if placeholders and (
                num_tokens + placeholders >= request.max_num_tokens
                or num_tokens + placeholders >= max_seq_len
            ):
                continue  # the tokens in flight end it
            num_new = num_tokens + placeholders - num_computed
            if num_new <= 0:
                continue  # its last token is in flight (pipeline, or a verify step)
            if placeholders and drafts is not None and self._waits_to_speculate(request):
                continue  # its drafts need the tokens in flight: once they are back
            req_id = request.request_id
            new_block_ids: list[int] | None
            if (
                num_new == 1
                and num_computed < max_model_len
                and num_computed < decode_limits.get(req_id, 0)
            ):
                new_block_ids = []  # the decode fast path: allocate_slots has nothing to do
                cost = 1  # (no prompt position: its one token's row samples)
            else:
                num_new = self._num_tokens_to_schedule(request, num_computed, budget)
                if num_new == 0:
                    continue
                new_block_ids = self._allocate_or_preempt(request, num_new, plan)
                if new_block_ids is None:
                    break  # the request preempted itself: nothing after it is running
                cost = budget_cost(request, num_computed, num_new)
            if drafts is not None and num_new == 1 and request.speculates:
                if request.spec_backoff:
                    request.spec_backoff -= 1  # (a decode without drafts)
                elif not placeholders:
                    draft_candidates.append((len(req_ids), request))
            num_scheduled[req_id] = num_new
            budget -= cost
            req_ids.append(req_id)
            num_computed_col.append(num_computed)
            block_ids_col.append(new_block_ids)
            num_computed += num_new
            request.num_computed_tokens = num_computed
            request.num_in_flight_steps += 1
            if async_scheduling and num_computed >= num_tokens:
                request.num_output_placeholders = placeholders + 1  # this step samples for it
        plan.token_budget = budget
        if draft_candidates:
            assert drafts is not None
            drafts.schedule_drafts(draft_candidates, plan)

    def _waits_to_speculate(self, request: Request) -> bool:
        """Async scheduling: whether a request with tokens in flight waits for
        them to get drafts (:meth:`DraftScheduler.waits_to_speculate`)."""
        drafts = self.drafts
        return drafts is not None and drafts.waits_to_speculate(request, len(self.running))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> list[int] | None:
        """Allocate, preempting the lowest-priority running requests as needed."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            plan.num_preempted += 1
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        while (
            self.waiting
            and plan.has_room(self.max_num_seqs)
            and len(self.running) < self.max_num_running_reqs
        ):
            request = self.waiting[0]
            if request.num_in_flight_steps:
                break  # preempted with a step in flight: resume once its output is back
            _, num_computed = kv.get_computed_blocks(request)
            num_new = self._num_tokens_to_schedule(request, num_computed, plan.token_budget)
            request.num_computed_tokens = num_computed
            new_block_ids = kv.allocate_slots(request, num_new) if num_new > 0 else None
            if new_block_ids is None:
                request.num_computed_tokens = 0
                kv.free(request)  # give back the prefix-cache hits
                break
            self.waiting.popleft()
            if request.status == RequestStatus.PREEMPTED:
                plan.resumed_reqs.append(request)
            else:
                plan.new_reqs.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.admitted_reqs.append(request)
            plan.num_scheduled_tokens[request.request_id] = num_new
            plan.token_budget -= budget_cost(request, num_computed, num_new)

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens the request gets this step; 0 when it must wait for a bigger budget.

        Without chunked prefill a request's tokens go in one step, except for
        a preempted request grown longer than the whole budget: it is
        recomputed in chunks, as it could never run again otherwise.
        """
        num_new = self._num_uncomputed(request, num_computed)
        num_new = min(num_new, self.max_model_len - num_computed)
        cost = budget_cost(request, num_computed, num_new)
        if cost > budget:
            chunkable = self.enable_chunked_prefill or cost > self.max_num_batched_tokens
            num_new = num_tokens_within(request, num_computed, budget) if chunkable else 0
        return max(num_new, 0)

    def _num_uncomputed(self, request: Request, num_computed: int) -> int:
        """Tokens the request lacks, counting its placeholders; 0 when the
        tokens in flight already end it (``max_tokens`` or the context)."""
        placeholders = request.num_output_placeholders
        num_tokens = request.num_tokens + placeholders
        if placeholders and (
            num_tokens >= request.max_num_tokens or num_tokens >= self.max_seq_len
        ):
            return 0
        return num_tokens - num_computed

    def _unsent_output_tokens(self, req_id: str) -> list[int]:
        request = self.requests[req_id]
        sent = self._num_output_tokens_sent.get(req_id, 0)
        self._num_output_tokens_sent[req_id] = request.num_output_tokens
        return list(request.output_token_ids[sent:])

    # -- results ---------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[str, EngineCoreOutput]:
        """Append the sampled tokens, apply the stop rules, free what finished.

        Returns an output for each request that got tokens, prompt
        log-probs or finished; requests aborted since ``schedule()`` are skipped.
        """
        outputs, stopped, freed = collect_step_results(
            scheduler_output,
            model_runner_output,
            self.requests,
            self._finishing,
            self.max_seq_len,
            self.spec_decoding_stats,
        )
        for request in freed:
            self._free_finished(request)
        if model_runner_output.draft_token_ids and self.drafts is not None:
            self.drafts.keep_drafts(model_runner_output.draft_token_ids, self.requests)
        if stopped:
            # A request preempted with a step in flight may stop from that step's
            # token: it waits in the queue, not among the running ones.
            self._remove_from_queues({r.request_id for r in stopped})
            for request in stopped:
                self._release(request)
        if model_runner_output.prompt_logprobs:
            add_prompt_logprobs(outputs, model_runner_output.prompt_logprobs, self.requests)
        return outputs

    # -- helpers ---------------------------------------------------------------

    def _remove_from_queues(self, request_ids: set[str]) -> None:
        self.running = [r for r in self.running if r.request_id not in request_ids]
        if any(r.request_id in request_ids for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if r.request_id not in request_ids)

    def _release(self, request: Request) -> None:
        """Forget a finished request: free its blocks (once no step in flight
        uses them) and report it to the runner in the next step."""
        del self.requests[request.request_id]
        self._num_output_tokens_sent.pop(request.request_id, None)
        if self.drafts is not None:
            self.drafts.forget(request.request_id)
        if request.num_in_flight_steps:
            self._finishing[request.request_id] = request
        else:
            self._free_finished(request)

    def _free_finished(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)

    def _check_fits(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise InvalidRequestError("prompt is empty; it needs at least one token")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; "
                f"the model's context (max_model_len) is {self.max_model_len}"
            )
        kv = self.kv_cache_manager
        if num_prompt > kv.token_capacity:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; the KV cache holds only "
                f"{kv.token_capacity} ({kv.num_blocks} blocks of {self.block_size})"
            )
        if not self.enable_chunked_prefill and num_prompt > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; without chunked prefill a step holds "
                f"at most {self.max_num_batched_tokens} (max_num_batched_tokens)"
            )
