"""The continuous-batching scheduler (vLLM v1's unified scheduler).

Holds :class:`Scheduler`, :class:`EngineCoreOutput` (one request's news from a
step) and :class:`SchedulerStats`. Pure Python; may import only the standard
library, msgspec and ``asyncstep.datatypes`` / ``asyncstep.config`` /
``asyncstep.errors`` (plus its siblings ``asyncstep.engine.request`` and
``asyncstep.engine.kv_cache_manager``).

One loop, no prefill/decode phases: every step hands each request the tokens
it lacks (``num_tokens - num_computed_tokens``: a prompt chunk, a whole prompt,
or the one token sampled last), within a token budget. The engine calls
``schedule()``, sends the result to the ranks, and later
``update_from_output()`` with that step's output; ``schedule()`` advances
``num_computed_tokens`` at once, so several steps may be in flight (the
engine's batch queue):

* **Async scheduling** (``async_scheduling=True``, one pipeline stage): a step
  that samples for a request leaves an *output placeholder*; the next step
  may already compute that token (the ranks take its id from the device, where
  the sampler left it), so the forward of step N+1 is launched before the
  engine knows step N's tokens. A request with placeholders is not scheduled
  past ``max_tokens``. A stop found in step N's output therefore comes one
  step late: the token step N+1 sampled for that request is dropped.
* **Pipeline parallelism** (``async_scheduling=False``, several steps in
  flight): the first stage needs each token's id, so a request is scheduled
  again only once its last token is back; steps in flight hold different
  requests (or prompt chunks) and keep every stage busy. Each step holds at
  most ``max_num_seqs`` requests; ``max_num_running_reqs`` (the engine sets
  ``pp_size * max_num_seqs``) may run at once, so every step in flight can
  be full.
* A request that finishes (stop, length, abort) while steps that include it
  are in flight keeps its blocks until those steps' outputs are back, and is
  reported in ``finished_req_ids`` only then. A preempted request frees its
  blocks at once (each rank runs its steps in order, so a step in flight has
  written them before a later step can reuse them) but is not resumed while
  a step that includes it is in flight.

Conventions the runner relies on:

* ``scheduled_new_reqs``: requests the runner has never seen, with ALL their
  block ids.
* ``scheduled_cached_reqs``: every other scheduled request. A request resumed
  after a preemption comes here with ``resumed_from_preemption=True`` and
  ``new_block_ids`` = ALL its block ids, which REPLACE the runner's (its
  ``num_computed_tokens`` restarts from its prefix-cache hits, often 0); for
  the others ``new_block_ids`` are the blocks appended this step.
  ``new_token_ids`` holds, with ``send_new_token_ids`` (pipeline parallelism),
  the output tokens each request produced since the ranks last heard of it
  (stages that do not sample need them as inputs); else empty lists.
* ``num_computed_tokens`` in both is the value before this step's tokens.
* ``finished_req_ids``: requests that ended (or were aborted) since the previous
  ``schedule()``, reported exactly once, even in a step that schedules no
  tokens: the runner drops their state, then runs no forward when
  ``total_num_scheduled_tokens == 0``.
* Preemption is by recompute: the victim's blocks are freed (its computed full
  blocks stay in the prefix cache) and it goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from asyncstep.config import CacheConfig, SchedulerConfig
from asyncstep.datatypes import (
    CachedRequestData,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncstep.engine.kv_cache_manager import KVCacheManager, KVCacheStats
from asyncstep.engine.request import FIRST_FINISHED_STATUS, Request, RequestStatus
from asyncstep.errors import ConfigError, InvalidRequestError

#: The sampled tokens of a request the runner's output does not list.
_NO_TOKENS: list[int] = []


class EngineCoreOutput(msgspec.Struct, frozen=True):
    """What one step produced for one request: new tokens and/or its end."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    #: The stop token id that ended it (None for EOS or a length cap).
    stop_reason: int | str | None = None
    #: One entry per new token, when the request asked for logprobs.
    new_logprobs: list[Logprobs] | None = None
    #: The prompt log-probs of the prompt positions the step computed (an
    #: output of a prompt chunk may hold these alone), when asked for.
    new_prompt_logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues and its KV cache."""

    step_id: int
    num_running_reqs: int
    num_waiting_reqs: int
    #: Preemptions since the scheduler started.
    num_preemptions: int
    kv_cache: KVCacheStats

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache.usage


class _StepPlan:
    """What one ``schedule()`` call has decided so far.

    The running requests scheduled are advanced at once (``num_computed_tokens``
    and the in-flight counts); their ``CachedRequestData`` columns are filled
    as they go (``num_computed_tokens`` before the step). Admitted waiting
    requests are advanced once the output is built.
    """

    __slots__ = (
        "admitted_reqs",
        "new_reqs",
        "num_preempted",
        "num_scheduled_tokens",
        "resumed_reqs",
        "running_new_block_ids",
        "running_num_computed",
        "running_req_ids",
        "token_budget",
    )

    def __init__(self, token_budget: int) -> None:
        # A plain class, not a dataclass: schedule() builds one every step.
        self.token_budget = token_budget
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[Request] = []
        self.resumed_reqs: list[Request] = []
        #: Waiting requests admitted, new and resumed, in order.
        self.admitted_reqs: list[Request] = []
        self.running_req_ids: list[str] = []
        self.running_num_computed: list[int] = []
        self.running_new_block_ids: list[list[int]] = []
        self.num_preempted = 0

    def has_room(self, max_num_seqs: int) -> bool:
        """Token budget left, and fewer than ``max_num_seqs`` requests."""
        return self.token_budget > 0 and len(self.num_scheduled_tokens) < max_num_seqs


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
    ) -> None:
        """``max_num_running_reqs``: requests admitted at once (default
        ``max_num_seqs``); more with a pipeline, whose steps in flight hold
        different requests. A step never holds more than ``max_num_seqs``.

        ``max_model_len``: the resolved context length
        (``config.model.max_model_len`` once the engine has resolved it);
        ConfigError unless positive."""
        if max_model_len <= 0:
            raise ConfigError(
                "max_model_len must be resolved (positive) before building the scheduler, "
                f"got {max_model_len}"
            )
        self.scheduler_config = scheduler_config
        self.send_new_token_ids = send_new_token_ids
        self.async_scheduling = async_scheduling
        #: request id -> output tokens already sent to the ranks (new_token_ids).
        self._num_output_tokens_sent: dict[str, int] = {}
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_running_reqs = max_num_running_reqs or self.max_num_seqs
        if self.max_num_running_reqs < self.max_num_seqs:
            raise ConfigError(
                f"max_num_running_reqs ({self.max_num_running_reqs}) must be at least "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        #: Longest a sequence may grow: the model's context, or the whole cache.
        self.max_seq_len = min(self.max_model_len, num_blocks * self.block_size)
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
            if num_tokens > request.num_computed_tokens:
                return True
        return False

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(
            step_id=self.step_id,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_cache=self.kv_cache_manager.statistics(),
        )

    # -- scheduling ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts (possibly none)."""
        plan = _StepPlan(self.max_num_batched_tokens)
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._schedule_waiting(plan)
        output = self._build_output(plan)
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

    def _schedule_running(self, plan: _StepPlan) -> None:
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
                continue  # its last token is in flight (pipeline)
            req_id = request.request_id
            new_block_ids: list[int] | None
            if (
                num_new == 1
                and num_computed < max_model_len
                and num_computed < decode_limits.get(req_id, 0)
            ):
                new_block_ids = []  # the decode fast path: allocate_slots has nothing to do
            else:
                num_new = self._num_tokens_to_schedule(request, num_computed, budget)
                if num_new == 0:
                    continue
                new_block_ids = self._allocate_or_preempt(request, num_new, plan)
                if new_block_ids is None:
                    break  # the request preempted itself: nothing after it is running
            num_scheduled[req_id] = num_new
            budget -= num_new
            req_ids.append(req_id)
            num_computed_col.append(num_computed)
            block_ids_col.append(new_block_ids)
            num_computed += num_new
            request.num_computed_tokens = num_computed
            request.num_in_flight_steps += 1
            if async_scheduling and num_computed >= num_tokens:
                request.num_output_placeholders = placeholders + 1  # this step samples for it
        plan.token_budget = budget

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: _StepPlan
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

    def _schedule_waiting(self, plan: _StepPlan) -> None:
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
            plan.token_budget -= num_new

    def _num_tokens_to_schedule(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens the request gets this step; 0 when it must wait for a bigger budget.

        Without chunked prefill a request's tokens go in one step, except for
        a preempted request grown longer than the whole budget: it is
        recomputed in chunks, as it could never run again otherwise.
        """
        num_new = self._num_uncomputed(request, num_computed)
        num_new = min(num_new, self.max_model_len - num_computed)
        if num_new > budget:
            chunkable = self.enable_chunked_prefill or num_new > self.max_num_batched_tokens
            num_new = budget if chunkable else 0
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

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        """The step's output; admitted waiting requests are not advanced yet."""
        kv = self.kv_cache_manager
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in plan.new_reqs
        ]
        req_ids = plan.running_req_ids
        num_running = len(req_ids)
        new_block_ids = plan.running_new_block_ids
        num_computed = plan.running_num_computed
        resumed = [False] * num_running
        for r in plan.resumed_reqs:
            req_ids.append(r.request_id)
            resumed.append(True)
            new_block_ids.append(kv.get_block_ids(r.request_id))
            num_computed.append(r.num_computed_tokens)
        if self.send_new_token_ids:
            requests = self.requests
            new_token_ids = [self._unsent_output_tokens(requests[i]) for i in req_ids]
        else:
            new_token_ids = [[] for _ in req_ids]
        cached_data = CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=resumed,
            new_token_ids=new_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=num_computed,
        )
        return SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - plan.token_budget,
            finished_req_ids=sorted(self.finished_req_ids) if self.finished_req_ids else [],
        )

    def _unsent_output_tokens(self, request: Request) -> list[int]:
        if not self.send_new_token_ids:
            return []
        sent = self._num_output_tokens_sent.get(request.request_id, 0)
        self._num_output_tokens_sent[request.request_id] = request.num_output_tokens
        return list(request.output_token_ids[sent:])

    # -- results ---------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[str, EngineCoreOutput]:
        """Append the sampled tokens, apply the stop rules, free what finished.

        Returns an output for each request that got tokens, prompt
        log-probs or finished; requests aborted since ``schedule()`` are skipped.
        """
        outputs: dict[str, EngineCoreOutput] = {}
        stopped: list[Request] = []
        requests = self.requests
        finishing = self._finishing
        index_of = model_runner_output.req_id_to_index
        all_sampled = model_runner_output.sampled_token_ids
        all_logprobs = model_runner_output.logprobs
        max_seq_len = self.max_seq_len
        first_finished = FIRST_FINISHED_STATUS
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id) or finishing.get(req_id)
            if request is None:
                continue
            index = index_of.get(req_id)
            sampled = all_sampled[index] if index is not None else _NO_TOKENS
            num_sampled = len(sampled)
            # The step is back: settle its accounting.
            request.num_in_flight_steps -= 1
            placeholders = request.num_output_placeholders
            if placeholders:
                request.num_output_placeholders = (
                    placeholders - num_sampled if placeholders > num_sampled else 0
                )
            if request.status >= first_finished:
                # Ended (the token of a late stop is dropped); free once no step holds it.
                if request.num_in_flight_steps == 0:
                    finishing.pop(req_id, None)
                    self._free_finished(request)
                continue
            if num_sampled == 1:  # a decode: one inline check of every stop rule
                token_id = sampled[0]
                request.append_output_token_id(token_id)
                new_token_ids = [token_id]
                num_tokens = request.num_tokens
                finished = (
                    token_id in request.stop_ids
                    or num_tokens >= request.max_num_tokens
                    or num_tokens >= max_seq_len
                ) and self._check_stop(request, token_id)
            elif num_sampled:
                new_token_ids = self._append_until_stop(request, sampled)
                finished = request.status >= first_finished
            else:
                continue  # a prompt chunk
            logprobs = None
            if all_logprobs is not None and index is not None:
                logprobs = all_logprobs[index][: len(new_token_ids)]
            if finished:
                stopped.append(request)
                outputs[req_id] = EngineCoreOutput(
                    req_id, new_token_ids, request.finish_reason, request.stop_reason, logprobs
                )
            else:
                outputs[req_id] = EngineCoreOutput(
                    req_id, new_token_ids, None, request.stop_reason, logprobs
                )
        if stopped:
            # A request preempted with a step in flight may stop from that step's
            # token: it waits in the queue, not among the running ones.
            self._remove_from_queues({r.request_id for r in stopped})
            for request in stopped:
                self._release(request)
        if model_runner_output.prompt_logprobs:
            self._add_prompt_logprobs(outputs, model_runner_output.prompt_logprobs)
        return outputs

    def _add_prompt_logprobs(
        self, outputs: dict[str, EngineCoreOutput], prompt_logprobs: dict[str, list[Logprobs]]
    ) -> None:
        """The step's prompt log-probs into the outputs: with its tokens, or
        alone (a prompt chunk) for a request still running."""
        for req_id, logprobs in prompt_logprobs.items():
            output = outputs.get(req_id)
            if output is not None:
                outputs[req_id] = msgspec.structs.replace(output, new_prompt_logprobs=logprobs)
            elif req_id in self.requests:
                outputs[req_id] = EngineCoreOutput(req_id, [], new_prompt_logprobs=logprobs)

    def _append_until_stop(self, request: Request, sampled: list[int]) -> list[int]:
        """Append tokens one by one until a stop rule fires; returns those appended."""
        for count, token_id in enumerate(sampled, start=1):
            request.append_output_token_id(token_id)
            if self._check_stop(request, token_id):
                return sampled[:count]
        return list(sampled)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Apply the stop rules to the request's newest token. A stop id
        counts only once ``min_tokens`` tokens are out (vLLM's ``check_stop``;
        the sampler bans them before that, so this guards the rule only)."""
        if token_id in request.stop_ids and request.num_output_tokens >= request.min_tokens:
            request.status = RequestStatus.FINISHED_STOPPED
            if request.sampling_params.ignore_eos or token_id not in request.eos_token_ids:
                request.stop_reason = token_id  # a stop token id, not EOS
        elif request.num_tokens >= request.max_num_tokens or request.num_tokens >= self.max_seq_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        else:
            return False
        return True

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
        if kv.num_blocks_for(num_prompt) > kv.num_blocks:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; the KV cache holds only "
                f"{kv.num_blocks * self.block_size} ({kv.num_blocks} blocks of {self.block_size})"
            )
        if not self.enable_chunked_prefill and num_prompt > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {num_prompt} tokens; without chunked prefill a step holds "
                f"at most {self.max_num_batched_tokens} (max_num_batched_tokens)"
            )
