"""Several front ends on one engine-core process (``open_shared_engine`` /
``attach_engine``, as ``asyncstep serve --api-server-count`` runs them):
each gets its own requests' tokens, equal to one front end alone; request
ids are each front end's own; one that leaves has its requests aborted
while the others keep being served; the core's death reaches them all."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

import asyncstep
from asyncstep import EngineDeadError, InvalidRequestError, SamplingParams
from asyncstep.engine.front_end.api import attach_engine, make_config, open_shared_engine
from asyncstep.engine.transport.core_client import CoreProcess

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # to the context
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [42], list(range(5, 30))]
TINY: dict[str, Any] = {"load_format": "dummy", "device": "cpu", "dtype": "float32"}


@contextlib.asynccontextmanager
async def shared_core(
    num_attached: int,
) -> AsyncIterator[tuple[asyncstep.Engine, list[asyncstep.Engine]]]:
    """The primary engine and ``num_attached`` front ends on its core (all in
    this process: each front end only needs its socket)."""
    config = make_config("tiny-llama", **TINY)
    pairs = [socket.socketpair() for _ in range(num_attached)]
    async with (
        open_shared_engine(config, [core for _, core in pairs]) as primary,
        contextlib.AsyncExitStack() as stack,
    ):
        attached = [
            await stack.enter_async_context(attach_engine(config, ours.detach(), i + 1))
            for i, (ours, _) in enumerate(pairs)
        ]
        yield primary, attached


async def tokens(engine: asyncstep.Engine, prompt: list[int], **kw: Any) -> list[int]:
    return (await engine.generate(prompt, GREEDY, **kw)).token_ids


@pytest.mark.trio
async def test_front_ends_of_one_core_get_the_tokens_of_one_front_end_alone() -> None:
    async with asyncstep.open_engine("tiny-llama", **TINY) as alone:
        expected = [await tokens(alone, p) for p in PROMPTS]
    async with shared_core(2) as (primary, attached):
        engines = [primary, *attached]
        got: dict[tuple[int, int], list[int]] = {}

        async def one(e: int, p: int) -> None:
            got[e, p] = await tokens(engines[e], PROMPTS[p])  # generated ids: req-0, ...

        async with trio.open_nursery() as nursery:
            for e in range(len(engines)):
                for p in range(len(PROMPTS)):
                    nursery.start_soon(one, e, p)
        assert all(got[e, p] == expected[p] for e, p in got) and len(got) == 12
        # Every front end's statistics see the one scheduler.
        for engine in engines:
            await engine.wait_idle()
        assert attached[1].statistics().num_steps == primary.statistics().num_steps > 0


@pytest.mark.trio
async def test_request_ids_and_aborts_are_each_front_ends_own() -> None:
    async with shared_core(2) as (_, (first, second)):
        stream = first.stream(PROMPTS[0], LONG, request_id="mine")
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            await stream.__anext__()  # in flight in the core
            with pytest.raises(InvalidRequestError, match="'mine' is already in flight"):
                await second.generate(PROMPTS[1], GREEDY, request_id="mine")
            second.abort("mine")  # not its request: nothing happens
            before = first.statistics().num_generated_tokens
            with trio.fail_after(30):
                while first.statistics().num_generated_tokens < before + 5:
                    await stream.__anext__()
        await first.wait_idle()  # its abort reached the core (one connection is in order)
        # Once it ended, the id is free again, for any front end.
        assert len(await tokens(second, PROMPTS[1], request_id="mine")) == 10


@pytest.mark.trio
async def test_a_front_end_that_leaves_has_its_requests_aborted() -> None:
    config = make_config("tiny-llama", **TINY)
    ours, core_end = socket.socketpair()
    async with open_shared_engine(config, [core_end]) as primary:
        async with attach_engine(config, ours.detach(), 1) as leaving, trio.open_nursery() as n:
            for prompt in PROMPTS:
                n.start_soon(_generate_forever, leaving, prompt)
            with trio.fail_after(30):
                async for _ in leaving.stream(PROMPTS[0], GREEDY):
                    break
            n.cancel_scope.cancel()  # the requests end with their front end
        # The primary's core is idle (the leaver's requests were aborted), still serving.
        with trio.fail_after(30):
            await primary.wait_idle()
        stats = primary.statistics()
        assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
        assert await tokens(primary, PROMPTS[2])


async def _generate_forever(engine: asyncstep.Engine, prompt: list[int]) -> None:
    with contextlib.suppress(EngineDeadError):
        await engine.generate(prompt, LONG)


@pytest.mark.trio
async def test_an_attached_front_end_closing_itself_leaves_the_core_serving() -> None:
    config = make_config("tiny-llama", **TINY)
    pairs = [socket.socketpair() for _ in range(2)]
    async with (
        open_shared_engine(config, [core for _, core in pairs]) as primary,
        attach_engine(config, pairs[0][0].detach(), 1) as staying,
    ):
        async with attach_engine(config, pairs[1][0].detach(), 2) as leaving:
            assert await tokens(leaving, PROMPTS[0])
        with trio.fail_after(30):
            assert await tokens(staying, PROMPTS[1]) == await tokens(primary, PROMPTS[1])


@pytest.mark.trio
async def test_the_core_dying_fails_every_front_end() -> None:
    config = make_config("tiny-llama", **TINY)
    ours, core_end = socket.socketpair()
    errors: list[EngineDeadError] = []

    async def one(engine: asyncstep.Engine) -> None:
        try:
            await engine.generate(PROMPTS[0], LONG)
        except EngineDeadError as exc:
            errors.append(exc)

    with pytest.raises(EngineDeadError, match="SIGKILL"):
        async with open_shared_engine(config, [core_end]) as primary:
            assert isinstance(primary.core, CoreProcess) and primary.core.pid is not None
            with pytest.raises(EngineDeadError, match="closed its connection"):
                async with attach_engine(config, ours.detach(), 1) as attached:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(one, attached)
                        with trio.fail_after(30):
                            async for _ in attached.stream(PROMPTS[1], GREEDY):
                                break
                        os.kill(primary.core.pid, signal.SIGKILL)
                    with trio.fail_after(10):
                        await attached.wait_stopped()
    assert len(errors) == 1
