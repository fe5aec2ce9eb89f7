"""The engine and its public API on a tiny random model: both async back-ends,
streaming, aborts, bad requests failing alone, preemption, a dying rank,
the per-step log events, and calls from another loop or thread failing at
once."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import trio
import trio.testing
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

import asyncstep
from asyncstep import EngineDeadError, EngineLoopError, InvalidRequestError, SamplingParams
from asyncstep.engine.front_end.engine import Engine
from asyncstep.engine.messages.core_messages import CoreReady, CoreStats, FromCore, ToCore
from asyncstep.engine.transport.core_client import EngineCoreDied
from asyncstep.logging import configure_logging
from asyncstep.models.model_loader import LoadedModel

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42]]


async def generate_all(
    engine: asyncstep.Engine, prompts: list[Any], params: SamplingParams
) -> list[Any]:
    results: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        try:
            results[i] = await engine.generate(prompts[i], params)
        except asyncstep.AsyncstepError as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.anyio
async def test_generate_and_stream_on_both_backends(
    tiny_model: LoadedModel, anyio_backend: str
) -> None:
    async with asyncstep.open_engine(tiny_model) as engine:
        results = await generate_all(engine, PROMPTS, GREEDY)
        assert all(len(r.token_ids) == 8 and r.finish_reason == "length" for r in results)
        chunks = [c async for c in engine.stream(PROMPTS[1], GREEDY)]
        assert [t for c in chunks for t in c.token_ids] == results[1].token_ids
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        assert engine.statistics().num_finished_reqs == 4


@pytest.mark.trio
async def test_bad_requests_fail_alone(tiny_model: LoadedModel) -> None:
    async with asyncstep.open_engine(tiny_model, max_model_len=32) as engine:
        bad = [
            [],  # empty
            list(range(1, 40)),  # longer than max_model_len
            [1, 2, 100_000],  # outside the vocabulary
            "text, but this model has no tokenizer",
            [{"role": "user", "content": "hi"}],  # chat without a tokenizer
            [1.5, 2],  # not token ids
        ]
        results = await generate_all(engine, [PROMPTS[0], *bad, PROMPTS[1]], GREEDY)
        assert len(results[0].token_ids) == 8 and len(results[-1].token_ids) == 8
        for error in results[1:-1]:
            assert isinstance(error, InvalidRequestError), error
            assert "\n" not in str(error)
        with pytest.raises(InvalidRequestError, match="logprobs must be <= 20"):
            await engine.generate(PROMPTS[0], SamplingParams(logprobs=21))
        # Still serving.
        assert len((await engine.generate(PROMPTS[2], GREEDY)).token_ids) == 8
    async with asyncstep.open_engine(tiny_model) as engine:
        endless = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        async for _ in engine.stream(PROMPTS[0], endless, request_id="x"):
            # In flight (to the context: thousands of tokens to go): its id is taken.
            with pytest.raises(InvalidRequestError, match="already in flight"):
                await engine.generate(PROMPTS[1], GREEDY, request_id="x")
            break  # leaving the stream aborts "x"
        # The aborted "x" may still hold blocks that steps in flight use: reusing
        # its id at once is refused (or served, if they are back); never fatal.
        with contextlib.suppress(InvalidRequestError):
            await engine.generate(PROMPTS[2], GREEDY, request_id="x")
        await engine.wait_idle()
        assert len((await engine.generate(PROMPTS[2], GREEDY, request_id="x")).token_ids) == 8


@pytest.mark.trio
async def test_context_limit_and_logprobs(tiny_model: LoadedModel) -> None:
    """max_tokens past what the context leaves is refused, naming the numbers
    (not cut short in silence); None asks for what it leaves."""
    async with asyncstep.open_engine(tiny_model, max_model_len=16) as engine:
        with pytest.raises(InvalidRequestError) as refused:
            await engine.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=100))
        assert str(refused.value) == (
            "max_tokens 100 does not fit: the prompt has 9 tokens and the model's context "
            "(max_model_len) is 16, which leaves 7: ask for at most 7"
        )
        assert engine.statistics().num_finished_reqs == 0
        for max_tokens in (7, None):
            fill = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            out = await engine.generate(PROMPTS[1], fill)
            assert out.finish_reason == "length" and len(PROMPTS[1]) + len(out.token_ids) == 16
        out = await engine.generate(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, logprobs=2)
        )
        assert out.logprobs is not None and len(out.logprobs) == 3
        for token, lp in zip(out.token_ids, out.logprobs, strict=True):
            assert lp.token_ids[0] == token and len(lp.token_ids) == 3
            assert lp.sampled_token_rank == 1  # greedy takes the most likely token
            assert lp.logprobs[0] == pytest.approx(lp.logprobs[1])


@pytest.mark.trio
async def test_cancelled_caller_aborts_its_request(tiny_model: LoadedModel) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with asyncstep.open_engine(tiny_model) as engine:
        received = 0
        with trio.CancelScope() as scope:
            async for chunk in engine.stream(PROMPTS[1], long):
                received += len(chunk.token_ids)
                if received >= 3:
                    scope.cancel()
        assert scope.cancelled_caught
        await engine.wait_idle()  # the aborted request's blocks wait for its steps in flight
        stats = engine.statistics()
        assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
        # generate() cancelled while waiting aborts too.
        with trio.move_on_after(0) as scope:
            await engine.generate(PROMPTS[0], long)
        assert engine.statistics().num_running_reqs == 0
        assert len((await engine.generate(PROMPTS[0], GREEDY)).token_ids) == 8


@pytest.mark.trio
async def test_preemption_gives_the_same_tokens(tiny_model: LoadedModel) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    async with asyncstep.open_engine(tiny_model) as engine:
        roomy = await generate_all(engine, PROMPTS, params)
    # 7 blocks of 4 tokens cannot hold three sequences of up to 29 tokens.
    async with asyncstep.open_engine(tiny_model, block_size=4, num_blocks=8) as engine:
        tight = await generate_all(engine, PROMPTS, params)
        assert engine.statistics().num_preemptions > 0
        assert engine.statistics().kv_cache_usage == 0.0
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]


@pytest.mark.trio
async def test_a_failing_rank_fails_requests_and_the_engine(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    forward = tiny_model.model.forward

    def failing_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device fell off the bus")
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny_model.model, "forward", failing_forward)
    with pytest.raises(EngineDeadError, match="device fell off the bus"):
        # Eager: CUDA-graph capture at start-up would call forward itself.
        async with asyncstep.open_engine(tiny_model, cudagraph_mode="NONE") as engine:
            with pytest.raises(EngineDeadError, match="device fell off the bus"):
                await engine.generate(PROMPTS[0], GREEDY)
            with pytest.raises(EngineDeadError):
                await engine.generate(PROMPTS[0], GREEDY)


@pytest.mark.trio
async def test_every_step_logs_one_event(tiny_model: LoadedModel, tmp_path: Path) -> None:
    log_file = tmp_path / "log.jsonl"
    configure_logging("warning", log_file)
    try:
        async with asyncstep.open_engine(tiny_model) as engine:
            await generate_all(engine, PROMPTS, GREEDY)
    finally:
        configure_logging("warning", None, console=False)
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    # One event per step, in order (a last step without tokens may have run
    # to tell the rank which requests ended).
    assert [e["step"] for e in steps] == list(range(len(steps)))
    assert sum(e["num_tokens"] > 0 for e in steps) == 8  # 1 prefill + 7 decodes
    for e in steps:
        assert e["rank"] == 0
        assert {"num_reqs", "num_tokens", "prepare_ms", "forward_ms", "sample_ms"} <= set(e)
    assert sum(e["num_tokens"] for e in steps) == sum(len(p) for p in PROMPTS) + 3 * 7


@pytest.mark.trio
async def test_an_error_in_the_callers_block_comes_out_as_raised(tiny_model: LoadedModel) -> None:
    with pytest.raises(KeyError, match="mine"):
        async with asyncstep.open_engine(tiny_model) as engine:
            await engine.generate(PROMPTS[0], GREEDY)
            raise KeyError("mine")
    # The model is free again for the next engine.
    async with asyncstep.open_engine(tiny_model) as engine:
        assert len((await engine.generate(PROMPTS[0], GREEDY)).token_ids) == 8


# ---------------------------------------------------------------------------
# An engine called from another event loop or thread


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_an_engine_called_off_its_loop_fails_at_once(tiny_model: LoadedModel, backend: str) -> None:
    other = "asyncio" if backend == "trio" else "trio"
    with (
        anyio.from_thread.start_blocking_portal(backend, name="engine-loop") as portal,
        portal.wrap_async_context_manager(asyncstep.open_engine(tiny_model)) as engine,
    ):

        async def generate() -> None:
            with anyio.fail_after(60):  # (a hang fails here)
                await engine.generate(PROMPTS[0], GREEDY)

        async def stream() -> None:
            with anyio.fail_after(60):
                async for _ in engine.stream(PROMPTS[0], GREEDY):
                    pass

        for call, loop in ((generate, other), (stream, other), (generate, backend)):
            with pytest.raises(EngineLoopError) as raised:
                anyio.run(call, backend=loop)
            message = str(raised.value)
            assert "\n" not in message
            assert message.startswith(
                f"this engine serves the {backend} event loop of thread 'engine-loop' and was "
                f"called from the {loop} event loop of thread 'MainThread': call it on its own "
                "loop (from another thread, through anyio.from_thread.run or a BlockingPortal)"
            )
        with pytest.raises(EngineLoopError, match="'MainThread', which runs no event loop"):
            engine.abort("req-0")
        # Through the portal, on its own loop: it serves on.
        assert len(portal.call(engine.generate, PROMPTS[0], GREEDY).token_ids) == 8
    # Closed, from any loop: it says so.
    with pytest.raises(EngineDeadError, match=r"^the engine is closed$"):
        anyio.run(generate, backend=other)


class _CoreThatDies:
    """A core that stops reading its queue (its transport's end is gone),
    then dies when told: the window in which a core process is SIGKILLed."""

    def __init__(self) -> None:
        self.reading_stopped = anyio.Event()
        self.die = anyio.Event()

    async def run(
        self,
        to_core: MemoryObjectReceiveStream[ToCore],
        from_core: MemoryObjectSendStream[FromCore | bytes],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await from_core.send(CoreReady(CoreStats()))
        task_status.started()
        to_core.close()
        self.reading_stopped.set()
        await self.die.wait()
        raise EngineCoreDied("the engine core process died (killed by signal SIGKILL)")


@pytest.mark.trio
async def test_closing_an_engine_whose_core_just_died_reports_the_death(
    tiny_model: LoadedModel,
) -> None:
    """aclose() (and an abort) in the window between the core's end going
    and the engine noticing: no BrokenResourceError, the death is reported."""
    config = asyncstep.make_config(None, max_model_len=64)
    core = _CoreThatDies()
    engine = Engine(config, tiny_model.arch_config, tiny_model.tokenizer, core)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.serve)
        await core.reading_stopped.wait()
        engine.abort("req-0")  # dropped: the core is gone
        nursery.start_soon(engine.aclose)
        await trio.testing.wait_all_tasks_blocked()
        core.die.set()
    assert isinstance(engine.error, EngineDeadError)
    assert "killed by signal SIGKILL" in str(engine.error)
