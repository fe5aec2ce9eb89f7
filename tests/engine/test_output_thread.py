"""The caller's loop does only what must be there (#38): the core's outputs
are processed on the engine's output thread, a ``generate`` caller is woken
once, a stream's reader once per batch of news; what the thread shares with
the callers goes through the engine's lock and one hand-off per batch; an
error of the thread ends the engine (every request with EngineDeadError),
never a hang.

No sleeps: a waiter is known to wait by ``wait_all_tasks_blocked``, a thread
by ``threading.Event``s."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import trio
import trio.testing

import asyncstep
from asyncstep import EngineDeadError, SamplingParams
from asyncstep.datatypes import FinishReason
from asyncstep.engine.core.engine_core import EngineCore
from asyncstep.engine.front_end.output_processor import OutputProcessor
from asyncstep.engine.front_end.output_thread import OutputThread, call_soon
from asyncstep.engine.front_end.request_state import RequestGroup, RequestState
from asyncstep.models.model_loader import LoadedModel

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42]]


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class CountedWaits:
    """Counts the callers' waits (``RequestGroup._waiting``: each is one wake-up)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = RequestGroup._waiting

        def counted(group: RequestGroup, wants_end: bool) -> anyio.Event:
            self.count += 1
            return original(group, wants_end)

        monkeypatch.setattr(RequestGroup, "_waiting", counted)


def group_of(n: int = 1, *, streamed: bool) -> RequestGroup:
    group = RequestGroup("r")
    for i in range(n):
        group.states.append(
            RequestState(
                f"r-{i}", None, [1, 2], GREEDY, None, index=i, group=group, streamed=streamed
            )
        )
    return group


# -- the engine ------------------------------------------------------------------


@pytest.mark.anyio
async def test_outputs_are_processed_on_the_output_thread(
    tiny_model: LoadedModel, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: set[str] = set()
    original = OutputProcessor.process_outputs

    def recorded(self: OutputProcessor, message: Any) -> None:
        threads.add(threading.current_thread().name)
        original(self, message)

    monkeypatch.setattr(OutputProcessor, "process_outputs", recorded)
    async with asyncstep.open_engine(tiny_model) as engine:
        out = await engine.generate(PROMPTS[0], GREEDY)
        chunks = [c async for c in engine.stream(PROMPTS[1], GREEDY)]
    assert len(out.token_ids) == 8 and sum(len(c.token_ids) for c in chunks) == 8
    assert threads == {"asyncstep-outputs"} != {threading.current_thread().name}


@pytest.mark.anyio
async def test_a_generate_caller_is_woken_once(
    tiny_model: LoadedModel, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits = CountedWaits(monkeypatch)
    async with asyncstep.open_engine(tiny_model) as engine:
        async with anyio.create_task_group() as tg:
            for prompt in PROMPTS:
                tg.start_soon(engine.generate, prompt, GREEDY)
        assert engine.statistics().num_steps >= 8  # eight steps each, one wake-up each
    assert waits.count == len(PROMPTS)


@pytest.mark.anyio
async def test_a_stream_reader_is_woken_at_most_once_per_chunk(
    tiny_model: LoadedModel, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits = CountedWaits(monkeypatch)
    async with asyncstep.open_engine(tiny_model) as engine:
        chunks = [c async for c in engine.stream(PROMPTS[1], GREEDY)]
    assert sum(len(c.token_ids) for c in chunks) == 8 and chunks[-1].finished
    assert waits.count <= len(chunks)


@pytest.mark.anyio
async def test_an_error_of_the_output_thread_ends_the_engine(
    tiny_model: LoadedModel, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: OutputProcessor, message: Any) -> None:
        raise RuntimeError("broken output processing")

    monkeypatch.setattr(OutputProcessor, "process_outputs", broken)
    with anyio.fail_after(60), pytest.raises(EngineDeadError, match="broken output processing"):
        async with asyncstep.open_engine(tiny_model) as engine:
            with pytest.raises(EngineDeadError, match="broken output processing"):
                await engine.generate(PROMPTS[0], GREEDY)
            await engine.wait_stopped()
    assert isinstance(engine.error, RuntimeError) and not engine.output_processor.requests


@pytest.mark.anyio
async def test_the_thread_error_is_named_when_the_core_breaks_first(
    tiny_model: LoadedModel, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a GPU run showed: the core's next send hits the closed
    stream (BrokenResourceError, a consequence) while the loop still waits
    for the failed thread to end; the thread's error is still the one named."""
    core_ended = threading.Event()
    original_run = EngineCore.run
    original_thread_run = OutputThread._run

    async def run(self: EngineCore, *args: Any, **kwargs: Any) -> None:
        try:
            await original_run(self, *args, **kwargs)
        finally:
            core_ended.set()

    def thread_run(self: OutputThread[Any]) -> None:
        original_thread_run(self)
        core_ended.wait(timeout=30)  # the thread ends only after the core broke

    def broken(self: OutputProcessor, message: Any) -> None:
        raise RuntimeError("broken output processing")

    monkeypatch.setattr(EngineCore, "run", run)
    monkeypatch.setattr(OutputThread, "_run", thread_run)
    monkeypatch.setattr(OutputProcessor, "process_outputs", broken)
    many = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with anyio.fail_after(60), pytest.raises(EngineDeadError, match="broken output processing"):
        async with asyncstep.open_engine(tiny_model) as engine:
            with pytest.raises(EngineDeadError, match="broken output processing"):
                await engine.generate(PROMPTS[0], many)
            await engine.wait_stopped()
    assert isinstance(engine.error, RuntimeError) and core_ended.is_set()


# -- the wake-ups, alone ---------------------------------------------------------


@pytest.mark.trio
async def test_a_stream_reader_gets_one_wake_up_and_one_chunk_for_a_batch_of_steps() -> None:
    group = group_of(streamed=True)
    (state,) = group.states
    chunks: list[Any] = []

    async def read() -> None:
        chunks.append(await group.next_chunk())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()  # the reader waits
        with group.lock:  # three steps' news in one batch (the output thread's side)
            for token in (5, 6, 7):
                state.add_output([token], None, None, None)
            woken = list(group.wakeups)
            group.wakeups.clear()
        assert len(woken) == 1 and not chunks
        woken[0].set()  # the one hand-off of the batch
    assert [c.token_ids for c in chunks] == [[5, 6, 7]]


@pytest.mark.trio
async def test_a_generate_waiter_is_not_woken_by_news_only_by_the_end() -> None:
    group = group_of(2, streamed=False)
    first, second = group.states
    done = trio.Event()

    async def wait() -> None:
        await group.wait_finished()
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        with group.lock:
            first.add_output([5], None, None, None)
            first.add_output([6], None, FinishReason.LENGTH, None)
            second.add_output([7], None, None, None)
            assert group.wakeups == []  # one choice ended, the other runs
            second.add_output([8], None, FinishReason.LENGTH, None)
            (woken,) = group.wakeups
            group.wakeups.clear()
        woken.set()
        await done.wait()
    assert [s.output().token_ids for s in group.states] == [[5, 6], [7, 8]]


# -- the thread and the hand-off -------------------------------------------------


@pytest.mark.trio
async def test_the_output_thread_runs_the_batches_in_order_then_stops() -> None:
    seen: list[tuple[str, list[int]]] = []
    thread = OutputThread[int](
        lambda batch: seen.append((threading.current_thread().name, batch)),
        lambda error: None,
    )
    thread.start()
    for batch in ([1], [2, 3], [4]):
        thread.put(batch)
    thread.stop()
    await thread.join()
    assert seen == [
        ("asyncstep-outputs", [1]),
        ("asyncstep-outputs", [2, 3]),
        ("asyncstep-outputs", [4]),
    ]
    assert thread.error is None


@pytest.mark.anyio
async def test_an_error_ends_the_output_thread_and_is_handed_to_the_loop(
    anyio_backend: str,
) -> None:
    loop = anyio.lowlevel.current_token()
    failed = anyio.Event()
    errors: list[BaseException] = []
    processed: list[int] = []

    def process(batch: list[int]) -> None:
        if batch == [2]:
            raise ValueError("bad batch")
        processed.extend(batch)

    def on_failure(error: BaseException) -> None:  # on the thread
        errors.append(error)
        assert call_soon(loop, failed.set)

    thread = OutputThread[int](process, on_failure)
    thread.start()
    for batch in ([1], [2], [3]):
        thread.put(batch)
    await failed.wait()
    await thread.join()  # ended without stop(): [3] is never processed
    assert processed == [1] and isinstance(thread.error, ValueError) and errors == [thread.error]


def test_call_soon_says_when_the_loop_has_ended() -> None:
    async def token() -> anyio.lowlevel.EventLoopToken:
        return anyio.lowlevel.current_token()

    assert call_soon(trio.run(token), lambda: None) is False
    assert call_soon(asyncio.run(token()), lambda: None) is False
