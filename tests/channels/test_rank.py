"""The rank actor's tasks with a scripted runner: the two-phase handshake
between the step and sampler tasks, output order, empty steps, shutdown by
closing the inbox, and an error in one task ending the rank."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch
import trio
import trio.testing

from asyncstep.datatypes import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    CachedRequestData,
    IntermediateTensors,
    ModelRunnerOutput,
    SchedulerOutput,
)
from asyncstep.nursery import RankActor
from asyncstep.runner.model_runner import REENTRY_ERROR
from asyncstep.runner.step_state import StepTimings


class ScriptedRunner:
    """Keeps the runner's contract and records the calls; ``sample_gate``
    holds sample_tokens until the test lets it go."""

    num_kv_blocks = 0
    device = torch.device("cpu")
    async_scheduling = False
    last_step_events = None

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pending: SchedulerOutput | None = None
        self.timings = StepTimings()
        self.sample_gate = threading.Event()
        self.sample_gate.set()
        self.sampling_started = threading.Event()
        self.fail_on_sample: int | None = None

    def execute_model(
        self,
        so: SchedulerOutput,
        intermediate_tensors: object = None,
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


class GatedPipe:
    """Stands in for a later stage's PipeStage: ``post_receive`` blocks until
    the test opens ``metadata`` (the previous stage has not sent yet)."""

    def __init__(self) -> None:
        self.metadata = threading.Event()
        self.posted: list[int] = []
        self.done: list[object] = []

    def post_receive(self, step_id: int) -> IntermediateTensors:
        assert self.metadata.wait(timeout=10)
        self.posted.append(step_id)
        return IntermediateTensors({"hidden_states": torch.full((1, 2), float(step_id))})

    async def drain(self, timeout_s: float) -> tuple[int, int]:
        return 0, 0  # nothing is sent from this stage

    def done_with(self, received: object) -> None:
        from asyncstep.nursery.pipe import PendingReceive

        assert isinstance(received, PendingReceive)
        self.done.append(received.result())


class ReadingRunner(ScriptedRunner):
    """Records whether a step's receive was posted when the runner began the
    step, then reads the tensors (as the forward does)."""

    def __init__(self) -> None:
        super().__init__()
        self.began = threading.Event()
        self.posted_at_begin: list[bool] = []
        self.read: list[float] = []

    def execute_model(
        self, so: SchedulerOutput, intermediate_tensors: object = None
    ) -> ModelRunnerOutput | None:
        from asyncstep.nursery.pipe import PendingReceive

        assert isinstance(intermediate_tensors, PendingReceive)
        self.posted_at_begin.append(intermediate_tensors.future.done())
        self.began.set()  # the step's inputs would be prepared here
        self.read.append(float(intermediate_tensors["hidden_states"][0, 0]))
        return super().execute_model(so, intermediate_tensors)


@pytest.mark.trio
async def test_a_later_stage_begins_its_step_before_the_previous_stage_sent() -> None:
    """The step task does not wait for the receive to be posted: the runner
    begins the step (input preparation) while the metadata is still on its
    way, and blocks only when it reads the tensors."""
    runner = ReadingRunner()
    actor = RankActor(runner)  # type: ignore[arg-type]
    pipe = GatedPipe()
    actor.pipe, actor.is_first_stage = pipe, False  # type: ignore[assignment]
    inbox_tx, inbox_rx = trio.open_memory_channel[SchedulerOutput](2)
    outbox_tx, outbox_rx = trio.open_memory_channel[ModelRunnerOutput](2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run, inbox_rx, outbox_tx)
        await inbox_tx.send(step(4))
        assert await trio.to_thread.run_sync(runner.began.wait, 10)
        await trio.testing.wait_all_tasks_blocked()
        assert runner.posted_at_begin == [False] and runner.read == []
        pipe.metadata.set()  # the previous stage sends
        assert (await outbox_rx.receive()).sampled_token_ids == [[4]]
        await inbox_tx.aclose()
    assert runner.read == [4.0] and pipe.posted == [4]
    assert len(pipe.done) == 1 and float(pipe.done[0]["hidden_states"][0, 0]) == 4.0  # type: ignore[index]
    assert actor.statistics().receives == 1


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


# -- a pipeline stage cancelled while its send is in flight (two processes, gloo)

DRAIN_SHAPE = (256, 1024)  # 1 MiB per tensor: a gloo send cannot finish before its receive


def stage_tensors(step_id: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step_id)
    return {
        "hidden_states": torch.randn(DRAIN_SHAPE, generator=g),
        "residual": torch.randn(DRAIN_SHAPE, generator=g),
    }


class FirstStageRunner(ScriptedRunner):
    """A first pipeline stage: every step returns intermediate tensors."""

    class _Model:
        @staticmethod
        def pp_all_gather_keys() -> dict[str, bool]:
            return {"hidden_states": True, "residual": True}

    model = _Model()

    def execute_model(
        self, so: SchedulerOutput, intermediate_tensors: object = None, **_: object
    ) -> Any:
        self.calls.append(f"execute {so.step_id}")
        return IntermediateTensors(stage_tensors(so.step_id))


async def scenario_cancel_stage_with_send_in_flight(groups: Any) -> dict[str, Any]:
    from asyncstep.channels.buffer_pool import BufferPool
    from asyncstep.channels.tensor_dict import recv_tensor_dict, warm_up

    await trio.to_thread.run_sync(lambda: warm_up(pp=groups.pp))
    out: dict[str, Any] = {}
    if groups.pp.is_first_rank:
        actor = RankActor(FirstStageRunner(), groups=groups, drain_timeout_s=30)  # type: ignore[arg-type]
        assert actor.pipe is not None
        actor.pipe.pool = BufferPool(poison=True)
        posted = threading.Event()
        send = actor.pipe.send

        def send_and_tell(*args: Any) -> Any:
            pending = send(*args)
            out["pending"] = pending
            posted.set()
            return pending

        actor.pipe.send = send_and_tell  # type: ignore[method-assign]
        inbox_tx, inbox_rx = trio.open_memory_channel[SchedulerOutput](1)
        outbox_tx, _ = trio.open_memory_channel[ModelRunnerOutput](1)
        inbox_tx.send_nowait(step(7, tokens=256))

        async def let_receiver_go() -> None:
            await trio.to_thread.run_sync(torch.distributed.barrier)

        async with trio.open_nursery() as outer:
            with trio.CancelScope() as rank_scope:
                async with trio.open_nursery() as rank:
                    rank.start_soon(actor.run, inbox_rx, outbox_tx)
                    assert await trio.to_thread.run_sync(posted.wait, 30)
                    out["done_at_cancel"] = out["pending"].done
                    out["in_use_at_cancel"] = actor.pipe.pool.statistics().in_use
                    outer.start_soon(let_receiver_go)  # the receive is posted only now
                    rank_scope.cancel()
        out["done_after"] = out.pop("pending").done
        out["stats"] = actor.pipe.pool.statistics()
    else:
        await trio.to_thread.run_sync(torch.distributed.barrier)
        received = await trio.to_thread.run_sync(
            lambda: recv_tensor_dict(pool=BufferPool(), step_id=7, pp=groups.pp, tp=groups.tp)
        )
        await received.wait()
        out["equal"] = all(torch.equal(received[k], v) for k, v in stage_tensors(7).items())
    return out


def test_a_cancelled_stage_drains_its_send_before_freeing_the_buffers() -> None:
    from distributed import run_world

    sender, receiver = run_world(
        scenario_cancel_stage_with_send_in_flight, world_size=2, pp_size=2, timeout_s=90
    )
    # Cancelled while the send was in flight, the rank waited for it (the
    # receiver posted its receive only after the cancel) and only then gave
    # the buffers back; the receiver saw exactly the data sent, no poison.
    assert sender["done_at_cancel"] is False and sender["in_use_at_cancel"] > 0
    assert sender["done_after"] is True
    assert sender["stats"].in_use == 0 and sender["stats"].released == sender["stats"].acquired
    assert receiver["equal"] is True


@pytest.mark.trio
async def test_a_rank_started_before_its_engine_waits_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from distributed import free_port

    from asyncstep.channels.control import ControlMessage, ControlStream, Hello
    from asyncstep.channels.framing import accept_peer
    from asyncstep.nursery.rank_main import connect_engine

    port = free_port()
    address = f"127.0.0.1:{port}"
    got: list[object] = []
    async with trio.open_nursery() as nursery:
        rank_connected = trio.Event()

        async def rank() -> None:
            stream = await connect_engine(address, "s3cret", timeout_s=30)
            await stream.send(Hello(3, 4, 1234, "host"))
            rank_connected.set()

        nursery.start_soon(rank)
        await trio.sleep(5)  # the engine comes up late (virtual seconds)
        assert not rank_connected.is_set()
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
        async with listener:
            engine_side = ControlStream(
                await listener.listeners[0].accept(),  # type: ignore[attr-defined]
                ControlMessage,
            )
            await accept_peer(engine_side, "s3cret")
            got.append(await engine_side.receive())
            await rank_connected.wait()
    assert got == [Hello(3, 4, 1234, "host")]


@pytest.mark.trio
async def test_a_rank_gives_up_on_an_engine_that_never_comes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from distributed import free_port

    from asyncstep.nursery.rank_main import connect_engine

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=rf"no engine answered at {address} within 2 s"):
        await connect_engine(address, "s3cret", timeout_s=2)
    with pytest.raises(ValueError, match="--engine must be HOST:PORT"):
        await connect_engine("localhost", "s3cret", timeout_s=2)


def test_a_forward_completing_between_two_queries_still_gives_its_buffers_back() -> None:
    """``PipeStage`` gives a receive's buffers back once the event recorded
    after its forward completed. An event that completes while the release
    pass runs must be seen done or pending, never neither."""
    from asyncstep.channels.parallel_state import GroupCoordinator
    from asyncstep.nursery.pipe import PipeStage

    class CompletesOnSecondQuery:
        def __init__(self) -> None:
            self.queries = 0

        def query(self) -> bool:
            self.queries += 1
            return self.queries > 1

    class Received:
        released = 0

        def release(self) -> None:
            self.released += 1

    single = GroupCoordinator.single()
    stage = PipeStage(single, single, torch.device("cpu"), {})
    received, event = Received(), CompletesOnSecondQuery()
    stage._releases.append((received, event))  # type: ignore[arg-type]
    stage._release_finished()  # the forward still runs: kept
    assert received.released == 0 and len(stage._releases) == 1
    stage._release_finished()  # it completed: given back, once
    stage._release_finished()
    assert received.released == 1 and stage._releases == []
    assert event.queries == 2
