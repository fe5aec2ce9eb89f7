"""One rank as an actor: a nursery of four long-lived tasks.

::

    inbox (SchedulerOutput) ──> step task ──> sampler task ──> outbox (ModelRunnerOutput)
                                 │   ▲
                    send task <──┘   └── recv task      (pipeline parallelism only)

* **step task** owns the runner's ``execute_model``: for each scheduler
  output, in order, it waits until the previous step's ``sample_tokens`` has
  been called (the runner's two-phase contract), then runs the step.
* **sampler task** calls ``sample_tokens`` for each step that left logits,
  and delivers every step's output to the outbox in step order.
* **recv task** and **send task** move intermediate tensors between pipeline
  stages; with a single stage nobody feeds them and they wait, idle, until
  shutdown.

Closing the inbox shuts the rank down in order: each task closes its outgoing
channel when its input ends. An error in any task cancels the others and
propagates out of :meth:`RankActor.run`. The runner's blocking work runs in a
worker thread (``to_thread``), so the event loop keeps serving the other tasks
during a forward; a cancelled task waits for that thread's work to finish (the
device work that uses the step's buffers cannot be abandoned).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.datatypes import IntermediateTensors, ModelRunnerOutput, SchedulerOutput
from asyncstep.logging import bind_rank, bound_step, get_logger
from asyncstep.runner.model_runner import ModelRunner

log = get_logger("rank")


@dataclass
class _StepResult:
    """A step on its way from the step task to the sampler task."""

    scheduler_output: SchedulerOutput
    #: Set when the step needs no sampling (an empty step).
    output: ModelRunnerOutput | None
    prepare_s: float
    forward_s: float
    #: Set by the sampler once ``sample_tokens`` was called: the runner may step again.
    sampled: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class RankStatistics:
    steps: int = 0
    forward_steps: int = 0
    tokens: int = 0


class RankActor:
    """Runs a :class:`ModelRunner` as a nursery of tasks (see the module doc)."""

    def __init__(self, runner: ModelRunner, *, rank: int = 0) -> None:
        self.runner = runner
        self.rank = rank
        self._stats = RankStatistics()

    def statistics(self) -> RankStatistics:
        return RankStatistics(**vars(self._stats))

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerOutput],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve steps from ``inbox`` until it is closed."""
        bind_rank(self.rank)
        to_sampler_tx, to_sampler_rx = anyio.create_memory_object_stream[_StepResult](1)
        send_tx, send_rx = anyio.create_memory_object_stream[IntermediateTensors](1)
        post_tx, post_rx = anyio.create_memory_object_stream[SchedulerOutput](1)
        recv_tx, recv_rx = anyio.create_memory_object_stream[IntermediateTensors](1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._recv_task, post_rx, recv_tx)
            tg.start_soon(self._send_task, send_rx)
            tg.start_soon(self._sampler_task, to_sampler_rx, outbox)
            tg.start_soon(self._step_task, inbox, to_sampler_tx, send_tx, post_tx, recv_rx)
            task_status.started()
        log.debug("rank stopped", **vars(self._stats))

    async def _step_task(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerOutput],
        to_sampler: MemoryObjectSendStream[_StepResult],
        send_tx: MemoryObjectSendStream[IntermediateTensors],
        post_tx: MemoryObjectSendStream[SchedulerOutput],
        recv_rx: MemoryObjectReceiveStream[IntermediateTensors],
    ) -> None:
        previous: _StepResult | None = None
        async with inbox, to_sampler, send_tx, post_tx, recv_rx:
            async for scheduler_output in inbox:
                if previous is not None:
                    await previous.sampled.wait()
                with bound_step(scheduler_output.step_id):
                    previous = await self._run_step(scheduler_output, to_sampler)

    async def _run_step(
        self, scheduler_output: SchedulerOutput, to_sampler: MemoryObjectSendStream[_StepResult]
    ) -> _StepResult:
        result = await anyio.to_thread.run_sync(self.runner.execute_model, scheduler_output)
        if isinstance(result, IntermediateTensors):
            raise RuntimeError("pipeline stages other than the last are not wired yet")
        timings = self.runner.timings
        step = _StepResult(scheduler_output, result, timings.prepare, timings.forward)
        if result is not None:
            step.sampled.set()  # nothing to sample: the runner is free at once
        await to_sampler.send(step)
        return step

    async def _sampler_task(
        self,
        steps: MemoryObjectReceiveStream[_StepResult],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
    ) -> None:
        async with steps, outbox:
            async for step in steps:
                with bound_step(step.scheduler_output.step_id):
                    output, sample_s = step.output, 0.0
                    if output is None:
                        t0 = time.perf_counter()
                        output = await anyio.to_thread.run_sync(self.runner.sample_tokens)
                        sample_s = time.perf_counter() - t0
                        step.sampled.set()
                    self._log_step(step, sample_s)
                    await outbox.send(output)

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

    async def _recv_task(
        self,
        posts: MemoryObjectReceiveStream[SchedulerOutput],
        recv_tx: MemoryObjectSendStream[IntermediateTensors],
    ) -> None:
        """Posts the receive of each step's intermediate tensors from the
        previous pipeline stage. A first stage posts none: the task waits until
        the step task closes ``posts``."""
        async with posts, recv_tx:
            async for _ in posts:
                raise RuntimeError("pipeline stages other than the first are not wired yet")

    async def _send_task(self, send_rx: MemoryObjectReceiveStream[IntermediateTensors]) -> None:
        """Sends intermediate tensors to the next stage and completes the
        sends. A single stage never feeds it: it ends when the step task does."""
        async with send_rx:
            async for _ in send_rx:
                raise RuntimeError("pipeline stages other than the last are not wired yet")
