"""The engine core in a process of its own (the default): the same tokens as
in-process, under Trio and asyncio; its death reaches every request as
EngineDeadError within seconds; a caller killed outright leaves no process
behind; bad configurations and models fail at open as they do in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import anyio
import pytest
import torch
import trio
from distributed import listening_sockets
from processes import alive, wait_gone

import asyncstep
from asyncstep import ConfigError, EngineDeadError, SamplingParams
from asyncstep.engine.transport.core_client import CoreProcess

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42], list(range(5, 40))]
TINY: dict[str, Any] = {"load_format": "dummy", "device": "cpu", "dtype": "float32"}


async def run_all(engine: asyncstep.Engine, params: SamplingParams) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        results[i] = (await engine.generate(PROMPTS[i], params)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return results


def core_pid(engine: asyncstep.Engine) -> int:
    assert isinstance(engine.core, CoreProcess) and engine.core.pid is not None
    return engine.core.pid


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.anyio
async def test_a_core_process_gives_the_tokens_of_an_in_process_core(anyio_backend: str) -> None:
    async with asyncstep.open_engine("tiny-llama", engine_process=False, **TINY) as engine:
        expected = await run_all(engine, GREEDY)
        streamed = [c async for c in engine.stream(PROMPTS[1], GREEDY)]
    async with asyncstep.open_engine("tiny-llama", **TINY) as engine:
        pid = core_pid(engine)
        assert pid != os.getpid() and alive(pid)
        assert await run_all(engine, GREEDY) == expected
        chunks = [c async for c in engine.stream(PROMPTS[1], GREEDY)]
        assert [t for c in chunks for t in c.token_ids] == expected[1]
        assert [t for c in streamed for t in c.token_ids] == expected[1]
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        # Aborts and wait_idle cross the boundary in order.
        with trio.move_on_after(0) if anyio_backend == "trio" else anyio.move_on_after(0):
            await engine.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        await engine.wait_idle()
        stats = engine.statistics()
        assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
        assert stats.num_finished_reqs == 5 and stats.num_steps > 0
    assert wait_gone(pid, 10)


@pytest.mark.trio
async def test_killing_the_core_fails_every_request_within_seconds() -> None:
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    errors: list[BaseException] = []

    async def one(engine: asyncstep.Engine, prompt: list[int]) -> None:
        try:
            await engine.generate(prompt, long)
        except EngineDeadError as exc:
            errors.append(exc)

    with pytest.raises(EngineDeadError, match="killed by signal SIGKILL"):
        async with asyncstep.open_engine("tiny-llama", **TINY) as engine:
            pid = core_pid(engine)
            async with trio.open_nursery() as nursery:
                for prompt in PROMPTS:
                    nursery.start_soon(one, engine, prompt)
                with trio.fail_after(30):  # the core is generating
                    async for _ in engine.stream(PROMPTS[0], GREEDY):
                        break
                os.kill(pid, signal.SIGKILL)
                killed_at = trio.current_time()
            assert trio.current_time() - killed_at < 10
    assert len(errors) == len(PROMPTS)
    assert all("killed by signal SIGKILL" in str(e) for e in errors)
    with pytest.raises(EngineDeadError):
        await engine.generate(PROMPTS[0], GREEDY)


def test_a_caller_killed_outright_leaves_no_process_behind() -> None:
    script = textwrap.dedent(
        """
        import sys, trio, asyncstep
        async def main():
            async with asyncstep.open_engine(
                "tiny-llama", load_format="dummy", device="cpu", dtype="float32"
            ) as engine:
                print(engine.core.pid, flush=True)
                params = asyncstep.SamplingParams(max_tokens=None, ignore_eos=True)
                await engine.generate([1, 2, 3], params)
        trio.run(main)
        """
    )
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        pid = int(caller.stdout.readline())
        assert alive(pid)
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=10)
        assert wait_gone(pid, 15), "the engine core outlived its caller"
    finally:
        caller.kill()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.trio
async def test_an_error_while_the_core_loads_comes_out_of_open_engine() -> None:
    # The child refuses the CUDA device it cannot see, as an in-process load does.
    with pytest.raises(ConfigError, match="no CUDA device"):
        async with asyncstep.open_engine("tiny-llama", **{**TINY, "device": "cuda"}):
            pass


@pytest.mark.trio
async def test_inline_launch_gives_the_same_tokens(tiny_model: Any) -> None:
    async with asyncstep.open_engine(tiny_model) as engine:
        expected = await run_all(engine, GREEDY)
    async with asyncstep.open_engine(tiny_model, launch_inline=True) as engine:
        assert await run_all(engine, GREEDY) == expected


@pytest.mark.trio
async def test_killing_the_core_of_a_tp_engine_leaves_no_rank_behind() -> None:
    with pytest.raises(EngineDeadError, match="killed by signal SIGKILL"):
        async with asyncstep.open_engine("tiny-llama", tensor_parallel_size=2, **TINY) as engine:
            pid, ranks = core_pid(engine), engine.rank_pids
            assert len(ranks) == 2 and all(alive(r) for r in ranks)
            assert len((await engine.generate(PROMPTS[0], GREEDY)).token_ids) == 12
            # Nothing listens off loopback; the core not at all once its
            # ranks are in (issue 14).
            listening = listening_sockets([os.getpid(), pid, *ranks])
            assert {a for _, a, _ in listening} <= {"127.0.0.1", "::1"}, listening
            assert {p for p, _, _ in listening} == set(ranks)  # gloo's, the store
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await engine.generate(PROMPTS[1], SamplingParams(max_tokens=500, ignore_eos=True))
    assert all(wait_gone(r, 15) for r in ranks), "a rank outlived its engine core"
