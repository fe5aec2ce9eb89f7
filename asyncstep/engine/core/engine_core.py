"""The engine core: the scheduler, the KV block bookkeeping and the step loop
that drives the ranks (vLLM v1's ``EngineCore``).

It reads :class:`~asyncstep.engine.messages.core_messages.CoreInputs` (requests added,
aborted, stopped) and answers with one
:class:`~asyncstep.engine.messages.core_messages.CoreOutputs` per step. It knows
nothing of text: tokenizing, detokenizing, stop strings and the client
streams are the front end's (:mod:`asyncstep.engine.front_end.engine`). The same class
runs in the caller's process (memory channels) or in the engine-core process
(:mod:`asyncstep.engine.transport.core_process`, over a socket).

The step loop keeps a **batch queue** of steps in flight (vLLM's
``step_with_batch_queue``): while it holds fewer than its depth and the
scheduler has work, it schedules and sends one more step; otherwise it takes
the oldest step's output. Depth 1 without overlap (one step at a time), 2
with async scheduling (step N+1 is on the ranks while step N is sampled and
its output sent to the front end), ``pp_size`` with pipeline parallelism.
Inputs are taken without waiting before every decision, and waited for only
when there is nothing else to do.

Nothing a request contains stops the loop: a request the scheduler refuses
is reported back in ``rejected``.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.config import EngineConfig
from asyncstep.datatypes import ModelRunnerOutput, RankInput, SchedulerOutput
from asyncstep.engine.core.request import Request, RequestStatus
from asyncstep.engine.core.scheduler import Scheduler
from asyncstep.engine.messages.core_messages import (
    CoreInputs,
    CoreOutputs,
    CoreReady,
    CoreStats,
    EngineCoreOutput,
    FromCore,
    Idle,
    RejectedRequest,
    Shutdown,
    ToCore,
    WaitIdle,
)
from asyncstep.engine.structured_output.manager import StructuredOutputManager
from asyncstep.errors import InvalidRequestError
from asyncstep.kv_cache_interface import KVCacheGroupSpec
from asyncstep.logging import get_logger
from asyncstep.logging.spans import now_us, record_span, span

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = get_logger("engine")


class Executor(Protocol):
    """Runs the ranks: scheduler outputs in, the last stage's outputs out.
    Reports the number of KV blocks through ``task_status`` once ready."""

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[RankInput],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
        *,
        task_status: TaskStatus[int] = ...,
    ) -> None: ...


class EngineCore:
    """The scheduler and its step loop over an :class:`Executor`."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        eos_token_ids: frozenset[int],
        *,
        vocab_size: int,
        load_tokenizer: Callable[[], PreTrainedTokenizerBase | None] = lambda: None,
        freeze_heap: bool = False,
        kv_cache_groups: tuple[KVCacheGroupSpec, ...] = (),
    ) -> None:
        """``vocab_size`` and ``load_tokenizer`` (called in a worker thread
        for the first request with ``structured_outputs``): the grammars'
        vocabulary. ``freeze_heap``: once the ranks are up, move every
        object alive into the garbage collector's permanent generation (see
        :func:`freeze_gc_heap`); for a process the core owns.
        ``kv_cache_groups``: the model's (the scheduler's KV cache manager's)."""
        self.kv_cache_groups = kv_cache_groups
        self.config = config
        self.freeze_heap = freeze_heap
        self.executor = executor
        self.eos_token_ids = eos_token_ids
        # Built by run() once the ranks report how many KV blocks they hold.
        self.scheduler: Scheduler = None  # type: ignore[assignment]
        self._rejected: list[RejectedRequest] = []
        #: A MoE model's rows per expert since the start (``CoreStats.moe_expert_tokens``).
        self._expert_tokens: list[int] = []
        self.structured_output = StructuredOutputManager(
            load_tokenizer, vocab_size, eos_token_ids, config.structured_outputs
        )
        #: Requests whose grammar is compiling (not yet with the scheduler),
        #: and the scope of each one's wait (cancelled when it is aborted).
        self._compiling: dict[str, Request] = {}
        self._compile_scopes: dict[str, anyio.CancelScope] = {}
        self._compiled = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._idle_tickets: list[int] = []
        self._inputs_closed = False
        self._shutting_down = False

    async def run(
        self,
        inputs: MemoryObjectReceiveStream[ToCore],
        events: MemoryObjectSendStream[FromCore],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start the ranks, send :class:`CoreReady`, then run the step loop
        until ``inputs`` closes (or says Shutdown) and the steps in flight
        are back. A failure while starting or later is raised."""
        to_rank_tx, to_rank_rx = anyio.create_memory_object_stream[RankInput](1)
        from_rank_tx, from_rank_rx = anyio.create_memory_object_stream[ModelRunnerOutput](1)
        async with anyio.create_task_group() as tg, events:
            num_blocks = await tg.start(self.executor.run, to_rank_rx, from_rank_tx)
            self.scheduler = self._build_scheduler(num_blocks)
            if self.scheduler.drafts is not None:
                # A grammar's drafts: the prefix its matcher accepts.
                self.scheduler.drafts.draft_filter = self.structured_output.valid_drafts
            if self.freeze_heap:
                freeze_gc_heap()
            rank_pids = list(getattr(self.executor, "pids", []))
            reads = getattr(self.executor, "weight_reads", None)
            await events.send(CoreReady(self.stats(), rank_pids, reads))
            task_status.started()
            try:
                async with anyio.create_task_group() as compiles:
                    self._task_group = compiles
                    compiles.start_soon(self.structured_output.run)
                    await self._step_loop(inputs, events, to_rank_tx, from_rank_rx)
                    compiles.cancel_scope.cancel()  # grammars still compiling
            finally:
                self.structured_output.close()

    def _build_scheduler(self, num_blocks: int) -> Scheduler:
        config = self.config
        return Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            send_new_token_ids=config.parallel.pipeline_parallel_size > 1,
            async_scheduling=config.uses_output_placeholders,
            max_num_running_reqs=config.max_num_running_reqs,
            max_model_len=config.model.max_model_len or 0,
            speculative_config=config.speculative_config,
            kv_cache_groups=self.kv_cache_groups,
        )

    def _count_expert_tokens(self, step: list[int] | None) -> None:
        """Add a step's rows per expert to the totals (:class:`CoreStats`)."""
        if not step:
            return
        totals = self._expert_tokens
        if len(totals) != len(step):
            totals[:] = [0] * len(step)
        for expert, count in enumerate(step):
            totals[expert] += count

    def stats(self) -> CoreStats:
        stats = self.scheduler.statistics()
        kv = stats.kv_cache
        spec = stats.spec_decoding
        return CoreStats(
            num_steps=stats.step_id,
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs,
            num_preemptions=stats.num_preemptions,
            kv_cache_usage=kv.usage,
            num_kv_blocks=kv.num_blocks,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            spec_decode_num_drafts=spec.num_drafts if spec else 0,
            spec_decode_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_decode_num_accepted_tokens_per_pos=(
                list(spec.num_accepted_tokens_per_pos) if spec else []
            ),
            moe_expert_tokens=list(self._expert_tokens),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
        )

    # -- inputs -----------------------------------------------------------

    def _take_inputs(self, inputs: MemoryObjectReceiveStream[ToCore]) -> None:
        """Apply every input already queued, without waiting."""
        while not self._inputs_closed:
            try:
                message = inputs.receive_nowait()
            except anyio.WouldBlock:
                return
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._inputs_closed = True
                return
            self._apply(message)

    async def _wait_input(self, inputs: MemoryObjectReceiveStream[ToCore]) -> None:
        """Wait for an input, or for a grammar to finish compiling."""
        if not self._compiling:
            await self._receive_input(inputs)
            return
        self._compiled = compiled = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def receive() -> None:
                await self._receive_input(inputs)
                tg.cancel_scope.cancel()

            tg.start_soon(receive)
            await compiled.wait()
            tg.cancel_scope.cancel()

    async def _receive_input(self, inputs: MemoryObjectReceiveStream[ToCore]) -> None:
        try:
            message = await inputs.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._inputs_closed = True
            return
        self._apply(message)

    def _apply(self, message: ToCore) -> None:
        if isinstance(message, CoreInputs):
            self._add_requests(message)
            for ended, status in (
                (message.aborted, RequestStatus.FINISHED_ABORTED),
                (message.stopped, RequestStatus.FINISHED_STOPPED),
            ):
                if ended:
                    self.scheduler.finish_requests(ended, status)
                    self.structured_output.remove(ended)
                    for req_id in ended:
                        self._stop_compiling(req_id)
        elif isinstance(message, WaitIdle):
            self._idle_tickets.append(message.ticket)
        elif isinstance(message, Shutdown):
            self._shutting_down = True
        else:  # CoreSetup / CoreStart are the transport's, taken before the core runs
            log.warning("engine core ignored a set-up message", message=type(message).__name__)

    def _add_requests(self, message: CoreInputs) -> None:
        for new in message.new_requests:
            request = Request(
                new.request_id, new.prompt_token_ids, new.sampling_params, self.eos_token_ids
            )
            if new.sampling_params.structured_outputs is not None:
                self._start_compiling(request, new.client)
            else:
                self._schedule_request(request)

    def _schedule_request(self, request: Request) -> None:
        try:
            self.scheduler.add_request(request)
        except InvalidRequestError as exc:
            self.structured_output.remove([request.request_id])
            self._rejected.append(RejectedRequest(request.request_id, str(exc)))

    def _start_compiling(self, request: Request, client: str) -> None:
        """Compile the request's grammar off the loop (among ``client``'s
        compiles); it goes to the scheduler once compiled, unless it was
        aborted meanwhile (its compile then stops, unless another request
        waits for the same grammar)."""
        req_id = request.request_id
        if req_id in self._compiling or req_id in self.scheduler.requests:
            self._rejected.append(RejectedRequest(req_id, f"request id {req_id!r} is in flight"))
            return
        self._compiling[req_id] = request
        scope = self._compile_scopes[req_id] = anyio.CancelScope()
        assert self._task_group is not None
        self._task_group.start_soon(self._compile, request, client, scope)

    def _stop_compiling(self, req_id: str) -> None:
        """``req_id`` went away: stop waiting for its grammar."""
        self._compiling.pop(req_id, None)
        scope = self._compile_scopes.pop(req_id, None)
        if scope is not None:
            scope.cancel()

    async def _compile(self, request: Request, client: str, scope: anyio.CancelScope) -> None:
        """Wait for the request's grammar in ``scope`` (cancelled if the
        request goes away), then schedule the request or refuse it."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        req_id = request.request_id
        with scope:
            try:
                compiled = await self.structured_output.compile(params, client)
            except InvalidRequestError as exc:
                if self._compiling.pop(req_id, None) is not None:
                    self._rejected.append(RejectedRequest(req_id, str(exc)))
            else:
                if self._compiling.pop(req_id, None) is not None:
                    self.structured_output.add(req_id, compiled, request.prompt_token_ids)
                    self._schedule_request(request)
        if self._compile_scopes.get(req_id) is scope:
            del self._compile_scopes[req_id]
        self._compiled.set()  # wakes the loop if it waits for inputs

    @property
    def _closing(self) -> bool:
        return self._inputs_closed or self._shutting_down

    # -- the loop ---------------------------------------------------------

    async def _step_loop(
        self,
        inputs: MemoryObjectReceiveStream[ToCore],
        events: MemoryObjectSendStream[FromCore],
        to_rank: MemoryObjectSendStream[RankInput],
        from_rank: MemoryObjectReceiveStream[ModelRunnerOutput],
    ) -> None:
        in_flight: deque[SchedulerOutput] = deque()
        depth = self.config.batch_queue_size
        scheduler = self.scheduler
        async with to_rank, from_rank:
            # Closing: schedule nothing more, but take the outputs in flight.
            while True:
                self._take_inputs(inputs)
                if self._rejected:
                    await self._send_outputs(events, -1, [])
                if self._closing and not in_flight:
                    break
                if (
                    not self._closing
                    and len(in_flight) < depth
                    and scheduler.has_work_to_schedule()
                ):
                    start_us = now_us()
                    scheduler_output = scheduler.schedule()
                    if self.structured_output.constrains(scheduler_output):
                        scheduler_output = msgspec.structs.replace(
                            scheduler_output, has_structured_output_requests=True
                        )
                    step = scheduler_output.step_id
                    record_span("schedule", "engine", start_us, now_us() - start_us, step=step)
                    await to_rank.send(scheduler_output)
                    in_flight.append(scheduler_output)
                    if len(in_flight) == 1:
                        await self._send_grammar(to_rank, scheduler_output)
                elif in_flight:
                    output = await from_rank.receive()
                    scheduler_output = in_flight.popleft()
                    with span("update", "engine", step=scheduler_output.step_id):
                        news = scheduler.update_from_output(scheduler_output, output)
                        self._count_expert_tokens(output.expert_tokens)
                    await self._advance_grammars(to_rank, news, in_flight)
                    await self._send_outputs(events, scheduler_output.step_id, list(news.values()))
                else:
                    if self._idle_tickets:
                        stats = self.stats()
                        for ticket in self._idle_tickets:
                            await events.send(Idle(ticket, stats))
                        self._idle_tickets.clear()
                    await self._wait_input(inputs)

    async def _advance_grammars(
        self,
        to_rank: MemoryObjectSendStream[RankInput],
        news: dict[str, EngineCoreOutput],
        in_flight: deque[SchedulerOutput],
    ) -> None:
        """The matchers take a step's tokens; then the next step in flight,
        if constrained, gets its bitmask (first: the device waits for it,
        its forward running meanwhile)."""
        next_step = in_flight[0] if in_flight else None
        if next_step is not None and not next_step.has_structured_output_requests:
            next_step = None
        if next_step is None and not self.structured_output.matchers:
            return
        step = next_step.step_id if next_step is not None else None
        with span("grammar", "engine", step=step):
            grammar_output = self.structured_output.advance(news.values(), next_step)
        if grammar_output is not None:
            await to_rank.send(grammar_output)

    async def _send_grammar(
        self, to_rank: MemoryObjectSendStream[RankInput], scheduler_output: SchedulerOutput
    ) -> None:
        """The bitmask of a constrained step, once every step before it is back."""
        if scheduler_output.has_structured_output_requests:
            with span("grammar", "engine", step=scheduler_output.step_id):
                grammar_output = self.structured_output.grammar_output(scheduler_output)
            await to_rank.send(grammar_output)

    async def _send_outputs(
        self,
        events: MemoryObjectSendStream[FromCore],
        step_id: int,
        outputs: list[EngineCoreOutput],
    ) -> None:
        rejected, self._rejected = self._rejected, []
        await events.send(CoreOutputs(step_id, outputs, self.stats(), rejected))


def freeze_gc_heap() -> None:
    """Collect, then move every object alive (the model, its CUDA graphs, the
    loop's machinery) into the garbage collector's permanent generation, so
    a full collection no longer walks them (vLLM's ``freeze_gc_heap``): one
    over a served model's objects holds the step loop for many steps
    (``benchmarks/studies/host/README.md``)."""
    gc.collect()
    gc.freeze()
