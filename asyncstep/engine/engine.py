"""The engine: requests in, text out. It owns the scheduler and the requests'
states, sends each step's :class:`SchedulerOutput` to the rank and feeds the
:class:`ModelRunnerOutput` back, then detokenizes and hands out chunks.

The step loop keeps a **batch queue** of steps in flight (vLLM's
``step_with_batch_queue``): while it holds fewer than its depth and the
scheduler has work, it schedules and sends one more step; otherwise it takes
the oldest step's output. Depth 1 without overlap (one step at a time), 2
with async scheduling (step N+1 is on the ranks while step N is sampled and
processed here), ``pp_size`` with pipeline parallelism (every stage busy).

Everything here runs on the caller's event loop (Trio, or asyncio through
AnyIO); :func:`asyncstep.open_engine` starts it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.config import EngineConfig
from asyncstep.datatypes import ModelRunnerOutput, SamplingParams, SchedulerOutput
from asyncstep.engine.outputs import Completion, CompletionChunk
from asyncstep.engine.request import Request, RequestStatus
from asyncstep.engine.request_state import RequestState
from asyncstep.engine.scheduler import Scheduler
from asyncstep.errors import EngineDeadError, InvalidRequestError, describe, leaves, root_cause
from asyncstep.logging import get_logger
from asyncstep.logging.spans import now_us, record_span, span
from asyncstep.models.config import ModelArchConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = get_logger("engine")

#: A prompt: text, token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


class Executor(Protocol):
    """Runs the ranks: scheduler outputs in, the last stage's outputs out.
    Reports the number of KV blocks through ``task_status`` once ready."""

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerOutput],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
        *,
        task_status: TaskStatus[int] = ...,
    ) -> None: ...


#: Most log-probs a request may ask for per position.
MAX_LOGPROBS = 20


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


class Engine:
    """Serves generation requests (use :func:`asyncstep.open_engine`)."""

    def __init__(
        self,
        config: EngineConfig,
        arch_config: ModelArchConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        executor: Executor,
    ) -> None:
        self.config = config
        self.arch_config = arch_config
        self.tokenizer = tokenizer
        self.executor = executor
        self.max_model_len = config.scheduler.max_model_len
        # Built by serve() once the ranks report how many KV blocks they hold.
        self.scheduler: Scheduler = None  # type: ignore[assignment]
        self.eos_token_ids = frozenset(arch_config.eos_token_ids) | _tokenizer_eos(tokenizer)
        self._requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._wakeup = anyio.Event()
        #: Set while the step loop has nothing in flight and nothing to schedule.
        self._idle = anyio.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._closing = False
        self._stopped = anyio.Event()
        self._num_generated_tokens = 0
        self._num_finished = 0

    # -- public API -------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> Completion:
        """Generate one completion and return it whole.

        Cancelling the caller aborts the request (its blocks are freed).
        """
        state = self._add_request(prompt, sampling_params, request_id)
        try:
            async for _ in self._chunks(state):
                pass
        finally:
            self._abort_unfinished(state)
        return state.completion()

    async def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[CompletionChunk]:
        """Generate one completion chunk by chunk (new text and tokens per step).

        Leaving the iteration early aborts the request.
        """
        state = self._add_request(prompt, sampling_params, request_id)
        try:
            async for chunk in self._chunks(state):
                yield chunk
        finally:
            self._abort_unfinished(state)

    def abort(self, request_id: str) -> None:
        """Abort a request in flight (no-op when it already ended)."""
        state = self._requests.get(request_id)
        if state is not None:
            self._abort_unfinished(state)

    async def wait_idle(self) -> None:
        """Wait until no step is in flight and nothing is left to schedule:
        aborted and finished requests have given back their blocks (they
        wait for the steps in flight that use them)."""
        self._check_alive()
        await self._idle.wait()

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text as ``tokenizer(text).input_ids``, chat
        messages through the tokenizer's chat template."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            ids = list(self._need_tokenizer()(prompt).input_ids)
        else:
            items = list(prompt)
            if items and all(isinstance(m, Mapping) for m in items):
                ids = self._apply_chat_template(cast(list[Mapping[str, Any]], items))
            elif all(isinstance(t, int) and not isinstance(t, bool) for t in items):
                ids = cast(list[int], items)
            else:
                raise InvalidRequestError(
                    "prompt must be a string, a list of token ids or a list of chat messages"
                )
        self._check_prompt(ids)
        return ids

    def statistics(self) -> EngineStatistics:
        stats = self.scheduler.statistics()
        kv = stats.kv_cache
        return EngineStatistics(
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs,
            num_steps=stats.step_id,
            num_preemptions=stats.num_preemptions,
            num_generated_tokens=self._num_generated_tokens,
            num_finished_reqs=self._num_finished,
            kv_cache_usage=kv.usage,
            num_kv_blocks=kv.num_blocks,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
        )

    # -- requests ---------------------------------------------------------

    def _add_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None
    ) -> RequestState:
        self._check_alive()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be <= {MAX_LOGPROBS}, got {params.logprobs}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        ids = self.encode_prompt(prompt)
        self.scheduler.add_request(Request(request_id, ids, params, self.eos_token_ids))
        state = RequestState(
            request_id, prompt if isinstance(prompt, str) else None, ids, params, self.tokenizer
        )
        self._requests[request_id] = state
        self._wakeup.set()
        return state

    async def _chunks(self, state: RequestState) -> AsyncIterator[CompletionChunk]:
        async with state.chunks_rx:
            async for chunk in state.chunks_rx:
                yield chunk
        if state.error is not None:
            raise EngineDeadError(
                f"request {state.request_id} failed: {describe(state.error)}"
            ) from state.error

    def _abort_unfinished(self, state: RequestState) -> None:
        if state.finished or state.error is not None:
            return
        self.scheduler.finish_requests(state.request_id, RequestStatus.FINISHED_ABORTED)
        self._requests.pop(state.request_id, None)
        state.abort()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {describe(self._error)}") from self._error
        if self._closed:
            raise EngineDeadError("the engine is closed")

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the model's context (max_model_len) is "
                f"{self.max_model_len}, and at least one token must be generated"
            )
        vocab = self.arch_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")

    def _need_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass the prompt as token ids")
        return self.tokenizer

    def _apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        tokenizer = self._need_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template")
        try:
            conversation: list[dict[str, Any]] = [dict(m) for m in messages]
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:  # jinja errors: a malformed conversation
            raise InvalidRequestError(f"chat template failed: {exc}") from None
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    # -- the loop ---------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the ranks, then run the step loop until cancelled. A failure
        while starting is raised; a failure later ends every request in
        flight with :class:`EngineDeadError`."""
        to_rank_tx, to_rank_rx = anyio.create_memory_object_stream[SchedulerOutput](1)
        from_rank_tx, from_rank_rx = anyio.create_memory_object_stream[ModelRunnerOutput](1)
        started = False
        try:
            async with anyio.create_task_group() as tg:
                num_blocks = await tg.start(self.executor.run, to_rank_rx, from_rank_tx)
                pp = self.config.parallel.pipeline_parallel_size
                self.scheduler = Scheduler(
                    self.config.scheduler,
                    self.config.cache,
                    num_blocks,
                    send_new_token_ids=pp > 1,
                    async_scheduling=self.config.uses_output_placeholders,
                    max_num_running_reqs=self.config.max_num_running_reqs,
                )
                started = True
                task_status.started()
                await self._step_loop(to_rank_tx, from_rank_rx)
        except BaseException as exc:
            found = leaves(exc)
            cancelled = anyio.get_cancelled_exc_class()
            if any(not isinstance(e, Exception | cancelled) for e in found):
                # Ctrl-C (or SystemExit) reached a task: not an engine failure.
                self._die(EngineDeadError("the engine was interrupted"))
                raise
            errors = [e for e in found if isinstance(e, Exception)]
            if not errors:
                raise  # plain cancellation: the engine is being closed
            error = root_cause(exc)
            if not started:
                raise error from error.__cause__
            self._die(error)
        finally:
            self._closed = True
            for state in list(self._requests.values()):
                state.fail(self._error or EngineDeadError("the engine is closed"))
            self._requests.clear()
            self._stopped.set()

    async def aclose(self, timeout_s: float = 10.0) -> bool:
        """Stop after the step in flight: requests still running fail with
        :class:`EngineDeadError`, the ranks are told to shut down. Returns
        False if that took longer than ``timeout_s`` (the caller then cancels)."""
        self._closing = True
        self._wakeup.set()
        with anyio.move_on_after(timeout_s):
            await self._stopped.wait()
            return True
        return False

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the engine, if one did."""
        return self._error

    async def _step_loop(
        self,
        to_rank: MemoryObjectSendStream[SchedulerOutput],
        from_rank: MemoryObjectReceiveStream[ModelRunnerOutput],
    ) -> None:
        in_flight: deque[SchedulerOutput] = deque()
        depth = self.config.batch_queue_size
        async with to_rank, from_rank:
            # Closing: schedule nothing more, but take the outputs in flight.
            while not (self._closing and not in_flight):
                if (
                    not self._closing
                    and len(in_flight) < depth
                    and self.scheduler.has_work_to_schedule()
                ):
                    start_us = now_us()
                    scheduler_output = self.scheduler.schedule()
                    record_span(
                        "schedule",
                        "engine",
                        start_us,
                        now_us() - start_us,
                        step=scheduler_output.step_id,
                    )
                    await to_rank.send(scheduler_output)
                    in_flight.append(scheduler_output)
                elif in_flight:
                    output = await from_rank.receive()
                    with span("update", "engine", step=in_flight[0].step_id):
                        self._process_output(in_flight.popleft(), output)
                else:
                    self._idle.set()
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    self._idle = anyio.Event()

    def _process_output(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        for req_id, news in self.scheduler.update_from_output(scheduler_output, output).items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            self._num_generated_tokens += len(news.new_token_ids)
            stop_string = state.add_output(
                news.new_token_ids, news.new_logprobs, news.finish_reason, news.stop_reason
            )
            if stop_string is not None and not news.finished:
                self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_STOPPED)
            if state.finished:
                self._num_finished += 1
                del self._requests[req_id]

    def _die(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            log.error("engine stopped", error=describe(error))


def _tokenizer_eos(tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset([eos]) if isinstance(eos, int) else frozenset()
