"""One rank as an actor: a nursery of four long-lived tasks.

::

    inbox ──> recv task ──(step, tensors)──> step task ──> sampler task ──> outbox
                                                │
                                            send task (deferred PP send completion)

* **recv task** owns the PP receive channel: for each step with tokens on a
  stage that is not the first, it posts the receive of the previous stage's
  intermediate tensors (metadata first, then the tensors into pooled
  buffers) and hands an ``AsyncIntermediateTensors`` (waited lazily, at first
  use) to the step task, ahead of the step that needs it.
* **step task** owns the runner's ``execute_model`` (``GPUWorker.execute_model``
  semantics): it waits until the previous step was sampled (the runner's
  two-phase contract) and until the previous step's sends completed
  (``_pp_send_work``), runs the step, and on a stage that is not the last
  posts the non-blocking send of its ``IntermediateTensors``.
* **send task** owns deferred send completion: it awaits each send's handles,
  and only then hands its buffers back to the pool; cancelled, it drains the
  sends still in flight in a shielded, time-bounded scope first.
* **sampler task** calls ``sample_tokens`` for each step that left logits
  and delivers every step's output to the outbox, in step order.

A step with no tokens opens no forward, no receive and no send. Closing the
inbox shuts the rank down in order: each task closes its outgoing channel
when its input ends. An error in any task cancels the others and propagates
out of :meth:`RankActor.run`. The runner's blocking work runs in a worker
thread, so the event loop keeps serving the other tasks during a forward.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.channels.parallel_state import GroupCoordinator, ParallelGroups
from asyncstep.channels.tensor_dict import PendingSend
from asyncstep.datatypes import IntermediateTensors, ModelRunnerOutput, SchedulerOutput
from asyncstep.logging import bind_rank, bound_step, get_logger
from asyncstep.nursery.pipe import PipeStage, ReceivedTensors, SendInFlight
from asyncstep.runner.model_runner import ModelRunner

log = get_logger("rank")

_T = TypeVar("_T")


class _Kind(enum.Enum):
    SAMPLE = "sample"  # logits are waiting for sample_tokens
    OUTPUT = "output"  # the output is ready (an empty step)
    NONE = "none"  # a stage that is not the last: nothing to deliver


@dataclass
class _StepResult:
    """A step on its way from the step task to the sampler task."""

    scheduler_output: SchedulerOutput
    kind: _Kind
    output: ModelRunnerOutput | None
    prepare_s: float
    forward_s: float
    #: Set once ``sample_tokens`` was called: the runner may step again.
    sampled: anyio.Event = field(default_factory=anyio.Event)


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
    ) -> None:
        self.runner = runner
        self.rank = rank
        tp = groups.tp if groups is not None else GroupCoordinator.single()
        pp = groups.pp if groups is not None else GroupCoordinator.single()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        #: The rank whose outputs the engine reads: first TP rank of the last stage.
        self.is_driver = self.is_last_stage and tp.is_first_rank
        self.pipe = (
            PipeStage(pp, tp, runner.device, runner.model.pp_all_gather_keys())
            if pp.world_size > 1
            else None
        )
        self.drain_timeout_s = drain_timeout_s
        self._stats = RankStatistics()

    def statistics(self) -> RankStatistics:
        return RankStatistics(**vars(self._stats))

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerOutput],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve steps from ``inbox`` until it is closed."""
        bind_rank(self.rank)
        Received = tuple[SchedulerOutput, ReceivedTensors | None]
        steps_tx, steps_rx = anyio.create_memory_object_stream[Received](1)
        to_sampler_tx, to_sampler_rx = anyio.create_memory_object_stream[_StepResult](1)
        send_tx, send_rx = anyio.create_memory_object_stream[SendInFlight](1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._recv_task, inbox, steps_tx)
            tg.start_soon(self._send_task, send_rx)
            tg.start_soon(self._sampler_task, to_sampler_rx, outbox)
            tg.start_soon(self._step_task, steps_rx, to_sampler_tx, send_tx)
            task_status.started(self.runner.num_kv_blocks)
        log.debug("rank stopped", **vars(self._stats))

    # -- recv task --------------------------------------------------------

    async def _recv_task(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerOutput],
        steps: MemoryObjectSendStream[tuple[SchedulerOutput, ReceivedTensors | None]],
    ) -> None:
        async with inbox, steps:
            async for scheduler_output in inbox:
                received = None
                if self.pipe is not None and self._needs_receive(scheduler_output):
                    received = await self._in_thread(
                        self.pipe.post_receive, scheduler_output.step_id
                    )
                    self._stats.receives += 1
                await steps.send((scheduler_output, received))

    def _needs_receive(self, scheduler_output: SchedulerOutput) -> bool:
        return scheduler_output.total_num_scheduled_tokens > 0 and not self.is_first_stage

    # -- step task --------------------------------------------------------

    async def _step_task(
        self,
        steps: MemoryObjectReceiveStream[tuple[SchedulerOutput, ReceivedTensors | None]],
        to_sampler: MemoryObjectSendStream[_StepResult],
        sends: MemoryObjectSendStream[SendInFlight],
    ) -> None:
        previous: _StepResult | None = None
        last_send: SendInFlight | None = None
        async with steps, to_sampler, sends:
            async for scheduler_output, received in steps:
                if previous is not None:
                    await previous.sampled.wait()
                if last_send is not None:  # GPUWorker: wait for the last step's sends first
                    await last_send.done.wait()
                with bound_step(scheduler_output.step_id):
                    previous, in_flight = await self._run_step(scheduler_output, received)
                    if in_flight is not None:
                        last_send = in_flight
                        await sends.send(in_flight)
                        self._stats.sends += 1
                    await to_sampler.send(previous)

    async def _run_step(
        self, scheduler_output: SchedulerOutput, received: ReceivedTensors | None
    ) -> tuple[_StepResult, SendInFlight | None]:
        result, pending = await self._in_thread(self._execute, scheduler_output, received)
        in_flight = SendInFlight(pending) if pending is not None else None
        timings = self.runner.timings
        if isinstance(result, IntermediateTensors):
            step = _StepResult(scheduler_output, _Kind.NONE, None, timings.prepare, timings.forward)
        elif result is None:
            step = _StepResult(
                scheduler_output, _Kind.SAMPLE, None, timings.prepare, timings.forward
            )
        else:
            step = _StepResult(
                scheduler_output, _Kind.OUTPUT, result, timings.prepare, timings.forward
            )
        if step.kind is not _Kind.SAMPLE:
            step.sampled.set()  # nothing to sample: the runner is free at once
        return step, in_flight

    def _execute(
        self, scheduler_output: SchedulerOutput, received: ReceivedTensors | None
    ) -> tuple[ModelRunnerOutput | IntermediateTensors | None, PendingSend | None]:
        """The step's blocking part, in a worker thread: the forward, then
        (not last stage) the non-blocking send of its intermediate tensors."""
        try:
            result = self.runner.execute_model(scheduler_output, received)
        finally:
            if received is not None and self.pipe is not None:
                self.pipe.done_with(received)
        pending = None
        if isinstance(result, IntermediateTensors) and self.pipe is not None:
            pending = self.pipe.send(result, scheduler_output.step_id)
        return result, pending

    # -- send task --------------------------------------------------------

    async def _send_task(self, sends: MemoryObjectReceiveStream[SendInFlight]) -> None:
        """Completes each send in order and only then hands its buffers back.
        Cancelled, it first drains every send still in flight (the pipe keeps
        them all, also one posted just before the cancellation)."""
        try:
            async with sends:
                async for in_flight in sends:
                    await in_flight.complete()
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
                    output, sample_s = step.output, 0.0
                    if step.kind is _Kind.SAMPLE:
                        t0 = time.perf_counter()
                        output = await self._in_thread(self.runner.sample_tokens)
                        sample_s = time.perf_counter() - t0
                        step.sampled.set()
                    self._log_step(step, sample_s)
                    if output is not None:
                        await outbox.send(output)

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run blocking device work in a worker thread, on this rank's device
        (a new thread's current CUDA device is device 0, whatever the rank's)."""
        return await anyio.to_thread.run_sync(self._on_device, fn, *args)

    def _on_device(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self.runner.device.type == "cuda":
            torch.cuda.set_device(self.runner.device)
        return fn(*args)

    def _log_step(self, step: _StepResult, sample_s: float) -> None:
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
            prepare_ms=round(step.prepare_s * 1e3, 3),
            forward_ms=round(step.forward_s * 1e3, 3),
            sample_ms=round(sample_s * 1e3, 3),
        )
