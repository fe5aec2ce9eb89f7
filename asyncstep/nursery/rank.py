"""One rank as an actor: a nursery of four long-lived tasks linked by memory
channels (drawn, with the overlap loop, in docs/architecture.md, "The
rank's nursery").

Contract:

* **recv task** owns the PP receive channel: on a stage that is not the
  first it hands each step with tokens to the step task at once, with a
  ``PendingReceive`` of the previous stage's intermediate tensors (the
  runner waits for them at their first use).
* **step task** owns the runner (``GPUWorker.execute_model``): it orders the
  step after the previous step's sends (``_pp_send_work``), then runs
  ``execute_model`` and, on the last stage, ``sample_tokens`` in one call on
  the rank's :class:`~asyncstep.device.host_stream.HostStream`; on a stage
  that is not the last it posts the non-blocking send of the
  ``IntermediateTensors``.
* **send task** owns deferred send completion: a send's buffers go back to
  the pool only once its handles completed; cancelled, it drains the sends
  in flight in a shielded, time-bounded scope first.
* **sampler task** delivers every step's output to the outbox in step order,
  once its sampled ids are on the host; with overlap, step N only once step
  N+1's forward has started.

A step with no tokens opens no forward, no receive and no send. Closing the
inbox shuts the rank down in order (each task closes its outgoing channel
when its input ends); an error in any task cancels the others and
propagates out of :meth:`RankActor.run`. Every task records step-timeline
spans (:mod:`asyncstep.logging.spans`) when tracing is on.

Imports: the units below it (runner, models, channels, datatypes, the device
runtime, logging).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.channels.parallel_state import GroupCoordinator, ParallelGroups
from asyncstep.channels.tensor_dict import PendingSend
from asyncstep.datatypes import (
    GrammarOutput,
    IntermediateTensors,
    ModelRunnerOutput,
    RankInput,
    SchedulerOutput,
    WeightReads,
)
from asyncstep.device.host_stream import HostStream
from asyncstep.device.stream import StreamEvent, await_future
from asyncstep.logging import bind_rank, bound_step, get_logger
from asyncstep.logging.spans import now_us, record_span, span, tracing
from asyncstep.models.weight_reads import weight_reads
from asyncstep.nursery.pipe import PendingReceive, PipeStage, ReceivedTensors, SendInFlight
from asyncstep.runner.async_output import AsyncModelRunnerOutput
from asyncstep.runner.model_runner import ModelRunner
from asyncstep.runner.step_state import StepEvents, StepTimings

log = get_logger("rank")

_T = TypeVar("_T")


@dataclass
class _StepResult:
    """A step on its way from the step task to the sampler task."""

    #: The step's place in this rank's order (0, 1, ...).
    seq: int
    scheduler_output: SchedulerOutput
    #: Ready at once: an empty step's output (None: nothing ready to deliver).
    output: ModelRunnerOutput | None
    timings: StepTimings
    #: What ``sample_tokens`` returned (last stage, a step with tokens).
    sampled: ModelRunnerOutput | AsyncModelRunnerOutput | None
    events: StepEvents | None
    #: Completed (from the launch thread) once the next step's forward is launched.
    next_launched: concurrent.futures.Future[None] = field(
        default_factory=concurrent.futures.Future
    )
    #: A MoE model's rows per expert in this step: a host copy, pinned (in
    #: flight) after a GPU step (None: no MoE).
    expert_tokens: torch.Tensor | None = None


@dataclass
class RankStatistics:
    steps: int = 0
    forward_steps: int = 0
    tokens: int = 0
    sends: int = 0
    receives: int = 0


class RankActor:
    """Runs a :class:`ModelRunner` as a nursery of tasks (see the module doc)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        rank: int = 0,
        groups: ParallelGroups | None = None,
        drain_timeout_s: float = 10.0,
        pp_tensor_lanes: bool = True,
        launch_inline: bool | None = None,
    ) -> None:
        """``launch_inline``: run the runner's calls on the event loop's
        thread, not a launch thread (see :class:`HostStream`'s ``inline``);
        None: inline on CUDA without pipeline parallelism, else a thread (on
        the CPU the thread is the device, and the overlap real; a later
        pipeline stage's step waits for the previous stage's metadata, which
        a launch thread waits for while the runner prepares the step).
        Inline, no hand-off to a thread is paid per call
        (``benchmarks/studies/host/README.md``)."""
        tp = groups.tp if groups is not None else GroupCoordinator.single()
        pp = groups.pp if groups is not None else GroupCoordinator.single()
        if launch_inline is None:
            launch_inline = runner.device.type == "cuda" and pp.world_size == 1
        self.runner = runner
        self.rank = rank
        #: A MoE model's per-step rows per expert (:meth:`MoeForCausalLM.step_expert_tokens`).
        self.step_expert_tokens: Callable[[], torch.Tensor | None] | None = getattr(
            getattr(runner, "model", None), "step_expert_tokens", None
        )
        self._expert_tokens: torch.Tensor | None = None
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        #: The rank whose outputs the engine reads: first TP rank of the last stage.
        self.is_driver = self.is_last_stage and tp.is_first_rank
        self.pipe = None
        if pp.world_size > 1:
            lanes = runner.model.pp_all_gather_keys()
            if not pp_tensor_lanes:
                lanes = dict.fromkeys(lanes, False)
            self.pipe = PipeStage(pp, tp, runner.device, lanes)
        self.drain_timeout_s = drain_timeout_s
        #: The launch thread: every runner call runs there, in order.
        self.stream = HostStream(f"rank{rank}", runner.device, inline=launch_inline)
        #: The receive thread: posts each step's PP receive, in step order.
        self.recv_stream = HostStream(f"rank{rank}-recv", runner.device)
        #: Steps taken from the inbox so far (the recv task counts them).
        self._num_received = 0
        #: One stage, overlap on: hand out step N once step N+1 was launched.
        self._deliver_after_next_launch = runner.async_scheduling and pp.world_size == 1
        self._stats = RankStatistics()

    @property
    def weight_reads(self) -> WeightReads:
        """The weight bytes this rank's forward steps read, by their size."""
        return weight_reads(self.runner.model)

    def statistics(self) -> RankStatistics:
        return RankStatistics(**vars(self._stats))

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[RankInput],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve steps from ``inbox`` until it is closed."""
        bind_rank(self.rank)
        Received = tuple[SchedulerOutput, PendingReceive | None]
        steps_tx, steps_rx = anyio.create_memory_object_stream[Received](1)
        to_sampler_tx, to_sampler_rx = anyio.create_memory_object_stream[_StepResult](1)
        send_tx, send_rx = anyio.create_memory_object_stream[SendInFlight](1)
        # At most one per step in flight: never full.
        grammar_tx, grammar_rx = anyio.create_memory_object_stream[GrammarOutput](math.inf)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._recv_task, inbox, steps_tx, grammar_tx)
                tg.start_soon(self._send_task, send_rx)
                tg.start_soon(self._sampler_task, to_sampler_rx, outbox)
                tg.start_soon(self._step_task, steps_rx, to_sampler_tx, send_tx, grammar_rx)
                task_status.started(self.runner.num_kv_blocks)
        finally:
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()
            # Not awaited, queued receives dropped: after a failure or a
            # cancellation a receive may wait for metadata that never comes.
            self.recv_stream.close(wait=False, cancel_pending=True)
        log.debug("rank stopped", **vars(self._stats))

    # -- recv task --------------------------------------------------------

    async def _recv_task(
        self,
        inbox: MemoryObjectReceiveStream[RankInput],
        steps: MemoryObjectSendStream[tuple[SchedulerOutput, PendingReceive | None]],
        grammars: MemoryObjectSendStream[GrammarOutput],
    ) -> None:
        async with inbox, steps, grammars:
            async for scheduler_output in inbox:
                if isinstance(scheduler_output, GrammarOutput):
                    if self.is_last_stage:  # the stage that samples
                        grammars.send_nowait(scheduler_output)
                    continue
                received = None
                if self.pipe is not None and self._needs_receive(scheduler_output):
                    with bound_step(scheduler_output.step_id):
                        context = contextvars.copy_context()  # the step's and rank's log fields
                    future = self.recv_stream.submit(
                        context.run, self._post_receive, scheduler_output.step_id
                    )
                    received = PendingReceive(scheduler_output.step_id, future)
                    self._stats.receives += 1
                self._num_received += 1
                await steps.send((scheduler_output, received))

    def _post_receive(self, step_id: int) -> ReceivedTensors:
        """On the receive thread: wait for a step's metadata, post its receives."""
        assert self.pipe is not None
        with span("recv_post", "recv"):
            return self.pipe.post_receive(step_id)

    def _needs_receive(self, scheduler_output: SchedulerOutput) -> bool:
        return scheduler_output.total_num_scheduled_tokens > 0 and not self.is_first_stage

    # -- step task --------------------------------------------------------

    async def _step_task(
        self,
        steps: MemoryObjectReceiveStream[tuple[SchedulerOutput, PendingReceive | None]],
        to_sampler: MemoryObjectSendStream[_StepResult],
        sends: MemoryObjectSendStream[SendInFlight],
        grammars: MemoryObjectReceiveStream[GrammarOutput],
    ) -> None:
        previous: _StepResult | None = None
        last_send: SendInFlight | None = None
        async with steps, to_sampler, sends, grammars:
            async for seq, (scheduler_output, received) in _enumerate(steps):
                with bound_step(scheduler_output.step_id):
                    # GPUWorker: the last step's sends first. On CUDA the
                    # device orders them (the stream waits, as NCCL's wait()
                    # does in vLLM); CPU (gloo) sends are waited here.
                    if last_send is not None and not last_send.on_device:
                        with span("wait_send", "step"):
                            await last_send.done.wait()
                    if received is not None and self.stream.inline:
                        # The step runs on this loop: wait for the receive's
                        # posting here, not blocked in the runner, so the
                        # sampler and the control plane go on meanwhile.
                        with span("wait_recv_post", "step"):
                            await await_future(received.future, shield=False)
                    launched = previous.next_launched if previous is not None else None
                    try:
                        previous, in_flight = await self._run_step(
                            seq, scheduler_output, received, launched, last_send, grammars
                        )
                    finally:
                        if launched is not None and not launched.done():
                            launched.set_result(None)  # no forward (or it failed)
                    if in_flight is not None:
                        last_send = in_flight
                        await sends.send(in_flight)
                        self._stats.sends += 1
                    await to_sampler.send(previous)

    async def _run_step(
        self,
        seq: int,
        scheduler_output: SchedulerOutput,
        received: PendingReceive | None,
        launched: concurrent.futures.Future[None] | None,
        order_after: SendInFlight | None,
        grammars: MemoryObjectReceiveStream[GrammarOutput],
    ) -> tuple[_StepResult, SendInFlight | None]:
        start_us = now_us()
        # A constrained step samples once its bitmask is here: the engine
        # fills it from the previous step's tokens while this forward runs.
        defer_sample = scheduler_output.has_structured_output_requests and self.is_last_stage
        args = (scheduler_output, received, launched, order_after, defer_sample)
        if tracing():  # spans recorded inside the forward (micro-batches) name the step
            with bound_step(scheduler_output.step_id):
                context = contextvars.copy_context()
            result, sampled, pending = await self.stream.run(context.run, self._execute, *args)
        else:
            result, sampled, pending = await self.stream.run(self._execute, *args)
        sample_us = 0
        if defer_sample and result is None:
            grammar_output = await _receive_grammar(grammars, scheduler_output.step_id)
            sample_us = now_us()
            sampled = await self.stream.run(self.runner.sample_tokens, grammar_output)
        timings = dataclasses.replace(self.runner.timings)
        events = self.runner.last_step_events if timings.forward else None
        in_flight = None
        if pending is not None:
            in_flight = SendInFlight(pending, scheduler_output.step_id, events)
        ready = result if isinstance(result, ModelRunnerOutput) else None
        step = _StepResult(seq, scheduler_output, ready, timings, sampled, events)
        step.expert_tokens, self._expert_tokens = self._expert_tokens, None
        if timings.forward:
            self._record_host_spans(start_us, timings, sample_us)
        return step, in_flight

    def _execute(
        self,
        scheduler_output: SchedulerOutput,
        received: PendingReceive | None,
        launched: concurrent.futures.Future[None] | None,
        order_after: SendInFlight | None = None,
        defer_sample: bool = False,
    ) -> tuple[
        ModelRunnerOutput | IntermediateTensors | None,
        ModelRunnerOutput | AsyncModelRunnerOutput | None,
        PendingSend | None,
    ]:
        """The step's blocking part, on the launch thread: the forward (after
        the device sends of ``order_after``, on the stream), then
        ``sample_tokens`` (the last stage: with async scheduling it only
        enqueues sampling, so the runner is free for the next step at once)
        or the non-blocking send of the intermediate tensors (other stages).
        ``defer_sample``: the forward only (the step task samples later)."""
        if order_after is not None and order_after.on_device:
            order_after.pending.order_current_stream()
        try:
            result = self.runner.execute_model(scheduler_output, received)
        finally:
            if received is not None and self.pipe is not None:
                self.pipe.done_with(received)
        if self.step_expert_tokens is not None and self.runner.timings.forward:
            # Copied before sampling is enqueued: on the host once the step's tokens are.
            counts = self.step_expert_tokens()
            self._expert_tokens = None if counts is None else counts.to("cpu", non_blocking=True)
        sampled = self.runner.sample_tokens() if result is None and not defer_sample else None
        # Only now, with the whole step enqueued: waking the event loop
        # earlier hands it the GIL while this thread still has kernels to
        # launch (measured: the device then idles ~0.5 ms a step).
        if launched is not None and not launched.done():
            launched.set_result(None)
        pending = None
        if isinstance(result, IntermediateTensors) and self.pipe is not None:
            pending = self.pipe.send(result, scheduler_output.step_id)
        return result, sampled, pending

    # -- send task --------------------------------------------------------

    async def _send_task(self, sends: MemoryObjectReceiveStream[SendInFlight]) -> None:
        """Completes each send in order and only then hands its buffers back.
        Cancelled, it first drains every send still in flight (the pipe keeps
        them all, also one posted just before the cancellation)."""
        try:
            async with sends:
                async for in_flight in sends:
                    with bound_step(in_flight.step_id), span("send_drain", "send"):
                        await in_flight.complete()
                    if in_flight.events is not None:
                        _record_device_spans(in_flight.events)
        finally:
            if self.pipe is not None:
                with anyio.CancelScope(shield=True):
                    drained, posted = await self.pipe.drain(self.drain_timeout_s)
                if posted:
                    log.info("pp sends drained", drained=drained, in_flight=posted)

    # -- sampler task -----------------------------------------------------

    async def _sampler_task(
        self,
        steps: MemoryObjectReceiveStream[_StepResult],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
    ) -> None:
        async with steps, outbox:
            async for step in steps:
                with bound_step(step.scheduler_output.step_id):
                    output = step.output
                    if step.sampled is not None:
                        output = await self._wait_output(step, step.sampled)
                    expert_tokens = None
                    # A GPU step without sampled tokens has no copy event to wait on.
                    if step.expert_tokens is not None and (
                        step.sampled is not None or not step.expert_tokens.is_pinned()
                    ):
                        expert_tokens = step.expert_tokens.tolist()
                        if output is not None:
                            output = msgspec.structs.replace(output, expert_tokens=expert_tokens)
                    self._log_step(step, expert_tokens)
                    if output is not None:
                        fields = {} if expert_tokens is None else {"expert_tokens": expert_tokens}
                        with span("output", "sampler", **fields):
                            await outbox.send(output)

    async def _wait_output(
        self, step: _StepResult, sampled: ModelRunnerOutput | AsyncModelRunnerOutput
    ) -> ModelRunnerOutput:
        """Step N's output once its tokens are on the host; with the next step
        already queued, only after that step's forward was launched."""
        if isinstance(sampled, AsyncModelRunnerOutput):
            # Not for a constrained step: the engine needs its tokens for the
            # next step's bitmask, which that step waits for after its forward
            # (on the CPU "launched" means computed: waiting would serialize).
            constrained = step.scheduler_output.has_structured_output_requests
            if (
                self._deliver_after_next_launch
                and not constrained
                and self._num_received > step.seq + 1
            ):
                with span("wait_next_launch", "sampler"):
                    await await_future(step.next_launched, shield=False)
            with span("copy_wait", "sampler"):
                await sampled.wait()
            output = sampled.get_output()
        else:
            output = sampled  # overlap off: the runner waited for the tokens
        if step.events is not None:
            _record_device_spans(step.events)
        return output

    def _record_host_spans(self, start_us: int, timings: StepTimings, sample_us: int = 0) -> None:
        """The step's host phases; ``sample_us``: when a deferred sample began
        (0: right after the launch)."""
        if tracing():
            prepare_us, launch_us = int(timings.prepare * 1e6), int(timings.forward * 1e6)
            record_span("prepare", "step", start_us, prepare_us)
            record_span("launch", "step", start_us + prepare_us, launch_us)
            if timings.sample:
                sample_start = sample_us or start_us + prepare_us + launch_us
                record_span("sample", "step", sample_start, int(timings.sample * 1e6))
            if timings.grammar:
                record_span("grammar_apply", "step", sample_start, int(timings.grammar * 1e6))

    def _log_step(self, step: _StepResult, expert_tokens: list[int] | None = None) -> None:
        """One ``step`` event per step (DEBUG), with the host phases' times
        (and a MoE model's rows per expert)."""
        so = step.scheduler_output
        self._stats.steps += 1
        self._stats.tokens += so.total_num_scheduled_tokens
        self._stats.forward_steps += so.total_num_scheduled_tokens > 0
        log.debug(
            "step",
            num_reqs=so.num_reqs,
            num_new_reqs=len(so.scheduled_new_reqs),
            num_tokens=so.total_num_scheduled_tokens,
            num_finished=len(so.finished_req_ids),
            prepare_ms=round(step.timings.prepare * 1e3, 3),
            forward_ms=round(step.timings.forward * 1e3, 3),
            sample_ms=round(step.timings.sample * 1e3, 3),
            **({} if expert_tokens is None else {"expert_tokens": expert_tokens}),
        )


async def _receive_grammar(
    grammars: MemoryObjectReceiveStream[GrammarOutput], step_id: int
) -> GrammarOutput:
    """Step ``step_id``'s bitmask (the next to come: the engine sends them in step order)."""
    with span("wait_grammar", "step"):
        try:
            grammar_output = await grammars.receive()
        except anyio.EndOfStream:
            raise RuntimeError(f"the inbox ended before step {step_id}'s grammar") from None
    if grammar_output.step_id != step_id:
        raise RuntimeError(
            f"step {step_id} got the grammar bitmask of step {grammar_output.step_id}"
        )
    return grammar_output


def _record_device_spans(events: StepEvents) -> None:
    """The device's view of a step (complete events only): the forward, and
    sampling with the copy of its ids to the host."""
    if not tracing() or not events.forward_end.query():
        return
    start, end = events.forward_start.timestamp_us(), events.forward_end.timestamp_us()
    record_span("forward", "device", start, end - start)
    copy_end: StreamEvent | None = events.copy_end
    if copy_end is not None and copy_end.query():
        record_span("sample_copy", "device", end, copy_end.timestamp_us() - end)


async def _enumerate(items: AsyncIterator[_T]) -> AsyncIterator[tuple[int, _T]]:
    index = 0
    async for item in items:
        yield index, item
        index += 1
