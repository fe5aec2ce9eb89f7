"""The rank actor's tasks with a scripted runner: the two-phase handshake
between the step and sampler tasks, output order, empty steps, shutdown by
closing the inbox, and an error in one task ending the rank."""

from __future__ import annotations

import threading

import pytest
import torch
import trio
import trio.testing

from asyncstep.datatypes import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    CachedRequestData,
    ModelRunnerOutput,
    SchedulerOutput,
)
from asyncstep.nursery import RankActor
from asyncstep.runner.model_runner import REENTRY_ERROR, StepTimings


class ScriptedRunner:
    """Keeps the runner's contract and records the calls; ``sample_gate``
    holds sample_tokens until the test lets it go."""

    num_kv_blocks = 0
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pending: SchedulerOutput | None = None
        self.timings = StepTimings()
        self.sample_gate = threading.Event()
        self.sample_gate.set()
        self.sampling_started = threading.Event()
        self.fail_on_sample: int | None = None

    def execute_model(
        self, so: SchedulerOutput, intermediate_tensors: object = None
    ) -> ModelRunnerOutput | None:
        if self.pending is not None:
            raise RuntimeError(REENTRY_ERROR)
        self.calls.append(f"execute {so.step_id}")
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.pending = so
        return None

    def sample_tokens(self) -> ModelRunnerOutput:
        self.sampling_started.set()
        self.sample_gate.wait(timeout=10)
        so = self.pending
        assert so is not None
        if so.step_id == self.fail_on_sample:
            raise ValueError(f"sampler broke at step {so.step_id}")
        self.pending = None
        self.calls.append(f"sample {so.step_id}")
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            ids, {r: i for i, r in enumerate(ids)}, [[so.step_id] for _ in ids]
        )


def step(step_id: int, tokens: int = 1) -> SchedulerOutput:
    sched = {"r": tokens} if tokens else {}
    return SchedulerOutput(step_id, [], CachedRequestData(), sched, tokens)


async def serve(runner: ScriptedRunner, steps: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
    inbox_tx, inbox_rx = trio.open_memory_channel[SchedulerOutput](len(steps))
    outbox_tx, outbox_rx = trio.open_memory_channel[ModelRunnerOutput](len(steps))
    actor = RankActor(runner)  # type: ignore[arg-type]
    for so in steps:
        inbox_tx.send_nowait(so)
    inbox_tx.close()
    await actor.run(inbox_rx, outbox_tx)
    return [out async for out in outbox_rx]


@pytest.mark.trio
async def test_steps_alternate_with_sampling_and_outputs_keep_order() -> None:
    runner = ScriptedRunner()
    outputs = await serve(runner, [step(0, 5), step(1), step(2, 0), step(3)])
    assert runner.calls == [
        "execute 0",
        "sample 0",
        "execute 1",
        "sample 1",
        "execute 2",
        "execute 3",
        "sample 3",
    ]
    assert [o.sampled_token_ids for o in outputs] == [[[0]], [[1]], [], [[3]]]


@pytest.mark.trio
async def test_next_step_waits_for_sample_tokens() -> None:
    runner = ScriptedRunner()
    runner.sample_gate.clear()
    inbox_tx, inbox_rx = trio.open_memory_channel[SchedulerOutput](2)
    outbox_tx, outbox_rx = trio.open_memory_channel[ModelRunnerOutput](2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(RankActor(runner).run, inbox_rx, outbox_tx)  # type: ignore[arg-type]
        await inbox_tx.send(step(0))
        await inbox_tx.send(step(1))
        # sample_tokens(0) has begun (in its thread) and is held at the gate;
        # then every task settles: the step task holds step 1.
        assert await trio.to_thread.run_sync(runner.sampling_started.wait, 10)
        await trio.testing.wait_all_tasks_blocked()
        # Step 1 is queued, but the runner is still waiting for step 0's sampling.
        assert runner.calls == ["execute 0"]
        runner.sample_gate.set()
        assert (await outbox_rx.receive()).sampled_token_ids == [[0]]
        assert (await outbox_rx.receive()).sampled_token_ids == [[1]]
        await inbox_tx.aclose()
    assert runner.calls == ["execute 0", "sample 0", "execute 1", "sample 1"]


@pytest.mark.trio
async def test_an_error_in_a_task_ends_the_rank() -> None:
    runner = ScriptedRunner()
    runner.fail_on_sample = 1
    with pytest.RaisesGroup(
        pytest.RaisesExc(ValueError, match="sampler broke at step 1"), flatten_subgroups=True
    ):
        await serve(runner, [step(0), step(1), step(2)])
    assert "execute 2" not in runner.calls


@pytest.mark.trio
async def test_closing_the_inbox_shuts_down_every_task() -> None:
    runner = ScriptedRunner()
    with trio.fail_after(5):
        assert await serve(runner, []) == []
    assert runner.calls == []
