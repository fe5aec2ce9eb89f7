"""``n`` choices of one prompt (vLLM's parallel sampling): the choices, their
seeds, their chunks, their aborts, and the prompt computed once."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import asyncstep
from asyncstep import SamplingParams
from asyncstep.errors import InvalidRequestError
from asyncstep.models.model_loader import LoadedModel

pytestmark = pytest.mark.anyio

PROMPT = [5 + (i * 7) % 400 for i in range(40)]  # 40 tokens: 2 full blocks of 16
SAMPLED = SamplingParams(n=4, temperature=0.9, top_k=50, seed=11, max_tokens=8, ignore_eos=True)
ENGINE: dict[str, Any] = {"max_num_seqs": 8, "block_size": 16}


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


async def test_n_choices_are_their_seeds_whatever_the_batch(tiny_model: LoadedModel) -> None:
    async with asyncstep.open_engine(tiny_model, **ENGINE) as engine:
        alone = await engine.generate(PROMPT, SAMPLED)
        results: dict[object, Any] = {}

        async def run(key: object, prompt: list[int], params: SamplingParams) -> None:
            results[key] = await engine.generate(prompt, params)

        async with anyio.create_task_group() as tg:  # the same request in a crowd
            for i in range(1, 6):
                tg.start_soon(run, i, [9, 8, 7, 6] * i, _replace(SAMPLED, n=2, seed=i))
            tg.start_soon(run, "n", PROMPT, SAMPLED)
        crowded = results["n"]
        singles = [
            await engine.generate(PROMPT, _replace(SAMPLED, n=1, seed=11 + i)) for i in range(4)
        ]
    assert [o.index for o in alone.outputs] == [0, 1, 2, 3]
    tokens = [o.token_ids for o in alone.outputs]
    assert len({tuple(t) for t in tokens}) > 1  # the choices differ
    assert [o.token_ids for o in crowded.outputs] == tokens
    assert [s.token_ids for s in singles] == tokens
    # The completion's own fields are choice 0's (n = 1 code keeps working).
    assert alone.token_ids == tokens[0] and alone.finish_reason == alone.outputs[0].finish_reason


async def test_the_prompt_is_computed_once(tiny_model: LoadedModel) -> None:
    greedy = SamplingParams(n=4, temperature=0, max_tokens=4, ignore_eos=True)
    async with asyncstep.open_engine(tiny_model, **ENGINE) as engine:
        result = await engine.generate(PROMPT, greedy)
        stats = engine.statistics()
    # Choices 1-3 find choice 0's two full blocks cached: 96 of 4 x 40 tokens queried.
    assert stats.prefix_cache_hit_rate == pytest.approx(3 * 32 / (4 * 40))
    assert len({tuple(o.token_ids) for o in result.outputs}) == 1  # greedy: all alike


async def test_without_prefix_caching_every_choice_computes_the_prompt(
    tiny_model: LoadedModel,
) -> None:
    async with asyncstep.open_engine(tiny_model, enable_prefix_caching=False, **ENGINE) as engine:
        result = await engine.generate(PROMPT, SAMPLED)
        assert engine.statistics().prefix_cache_hit_rate == 0.0
    assert len(result.outputs) == 4


async def test_stream_chunks_carry_their_choice(tiny_model: LoadedModel) -> None:
    async with asyncstep.open_engine(tiny_model, **ENGINE) as engine:
        whole = await engine.generate(PROMPT, SAMPLED)
        streamed: dict[int, list[int]] = {}
        ended = set()
        async for chunk in engine.stream(PROMPT, SAMPLED, request_id="s"):
            assert chunk.request_id == "s" and chunk.index not in ended
            streamed.setdefault(chunk.index, []).extend(chunk.token_ids)
            if chunk.finished:
                ended.add(chunk.index)
    assert ended == {0, 1, 2, 3}
    assert [streamed[i] for i in range(4)] == [o.token_ids for o in whole.outputs]


async def test_leaving_early_aborts_every_choice(tiny_model: LoadedModel) -> None:
    long = _replace(SAMPLED, max_tokens=200)
    async with asyncstep.open_engine(tiny_model, **ENGINE) as engine:
        stream = engine.stream(PROMPT, long, request_id="gone")
        chunk = await stream.__anext__()  # choice 0's first chunk: the others were just sent
        await stream.aclose()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await engine.generate(PROMPT, long, request_id="cancelled")
        await engine.wait_idle()
        stats = engine.statistics()
        again = await engine.generate(PROMPT, _replace(SAMPLED, max_tokens=2), request_id="gone")
    assert chunk.index == 0
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0.0
    assert len(again.outputs) == 4  # the id is free again


async def test_n_in_the_engine_core_process() -> None:
    async with asyncstep.open_engine(
        "tiny-llama", load_format="dummy", device="cpu", dtype="float32", **ENGINE
    ) as engine:
        result = await engine.generate(PROMPT, SAMPLED)
        hit_rate = engine.statistics().prefix_cache_hit_rate
    assert [o.index for o in result.outputs] == [0, 1, 2, 3]
    assert hit_rate == pytest.approx(3 * 32 / (4 * 40))


@pytest.mark.parametrize("n", [0, -1, 129, 10**6, 2.0, "2", True, None])
def test_bad_n_is_refused(n: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"^n must be an integer"):
        SamplingParams(n=n)  # type: ignore[arg-type]


async def test_a_choice_id_in_flight_is_refused(tiny_model: LoadedModel) -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    async with asyncstep.open_engine(tiny_model, **ENGINE) as engine:
        running = engine.stream(PROMPT, long, request_id="x-1")
        await running.__anext__()  # in flight
        with pytest.raises(InvalidRequestError, match="'x-1' is already in flight"):
            await engine.generate(PROMPT, SAMPLED, request_id="x")
        await running.aclose()
        ok = await engine.generate(PROMPT, _replace(SAMPLED, max_tokens=2), request_id="x")
    assert len(ok.outputs) == 4


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__struct_fields__ if not f.startswith("_")}


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    return SamplingParams(**{**_fields(params), **changes})
