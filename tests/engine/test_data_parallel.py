"""Data-parallel replicas (``--data-parallel-size``): the router's rule
(the longest prefix wins, a much busier replica is skipped, round robin,
dead replicas skipped); the flags checked at the door; two replicas of the
tiny model (one spawn of two engine cores, shared by the checks) give one
engine's greedy tokens, route aborts to the replica holding the request,
and outlive one replica's death: only its requests fail, naming it,
``/health`` says which died, the metrics carry a ``replica`` label."""

from __future__ import annotations

import os
import signal
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

import asyncstep
from asyncstep import ConfigError, EngineDeadError, SamplingParams
from asyncstep.engine.front_end.data_parallel import summed_statistics
from asyncstep.engine.front_end.dp_router import (
    DataParallelRouter,
    prompt_block_hashes,
    replica_load,
)
from asyncstep.engine.front_end.statistics import EngineStatistics
from asyncstep.engine.transport.core_client import CoreProcess
from asyncstep.server import ServerConfig, build_app
from asyncstep.server.serve import check_layout

TINY: dict[str, Any] = {"load_format": "dummy", "device": "cpu", "dtype": "float32"}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42], list(range(5, 40))]
BOTH = [True, True]
SYSTEM = list(range(100, 164))  # four blocks of 16


# -- the router ----------------------------------------------------------------


def test_the_load_weighs_waiting_four_times_running() -> None:
    assert replica_load(num_waiting=2, num_running=3) == 11


def test_the_replica_holding_the_longest_prefix_wins() -> None:
    router = DataParallelRouter(2, "prefix", block_size=16, balance_threshold=8)
    assert router.route([*SYSTEM, 1, 2], [0, 0], BOTH) == 0  # nothing held: the least loaded
    assert router.route([7] * 64, [4, 0], BOTH) == 1
    # The same system prompt goes back to replica 0 though it is a little busier.
    assert router.route([*SYSTEM, 3, 4], [6, 1], BOTH) == 0
    assert router.route([7] * 64 + [5], [6, 5], BOTH) == 1
    # Longest run of leading blocks: replica 1 holds 3 blocks of this one, 0 holds 2.
    router.route(SYSTEM[:32] + [9] * 32, [0, 0], BOTH)  # replica 0 again (2 blocks held)
    router.records[1].add(prompt_block_hashes(SYSTEM[:48] + [8] * 16, 16))
    assert router.route(SYSTEM[:48] + [8] * 16, [2, 2], BOTH) == 1


def test_a_much_busier_replica_is_skipped_and_then_holds_the_prefix_too() -> None:
    router = DataParallelRouter(2, "prefix", block_size=16, balance_threshold=8)
    assert router.route(SYSTEM, [0, 0], BOTH) == 0
    assert router.route(SYSTEM, [8, 0], BOTH) == 0  # at the threshold: still the prefix
    assert router.route(SYSTEM, [9, 0], BOTH) == 1  # past it: the least loaded
    assert router.records[1].matched(prompt_block_hashes(SYSTEM, 16)) == 4
    assert router.route(SYSTEM, [9, 3], BOTH) == 1  # both hold it: the less loaded


def test_a_prompt_shorter_than_a_block_goes_by_load() -> None:
    router = DataParallelRouter(3, "prefix", block_size=16)
    assert router.route([1, 2, 3], [5, 2, 7], [True] * 3) == 1
    assert router.route([1, 2, 3], [5, 2, 7], [True] * 3) == 1


def test_round_robin_and_load_policies_and_dead_replicas() -> None:
    turns = DataParallelRouter(3, "round-robin")
    assert [turns.route(SYSTEM, [0, 0, 0], [True] * 3) for _ in range(4)] == [0, 1, 2, 0]
    assert [turns.route(SYSTEM, [0, 0, 0], [True, False, True]) for _ in range(3)] == [2, 0, 2]
    load = DataParallelRouter(3, "load")
    assert load.route(SYSTEM, [3, 1, 1], [True] * 3) == 1
    assert load.route(SYSTEM, [3, 1, 1], [True, False, True]) == 2
    prefix = DataParallelRouter(2, "prefix", block_size=16)
    assert prefix.route(SYSTEM, [0, 0], BOTH) == 0
    assert prefix.route(SYSTEM, [0, 0], [False, True]) == 1  # its holder died
    with pytest.raises(ValueError, match="no data-parallel replica is alive"):
        prefix.route(SYSTEM, [0, 0], [False, False])


def test_the_prefix_record_is_bounded() -> None:
    router = DataParallelRouter(1, "prefix", block_size=16, capacity_blocks=4)
    router.route(SYSTEM, [0], [True])
    router.route([5] * 32, [0], [True])
    assert len(router.records[0]) == 4
    assert router.records[0].matched(prompt_block_hashes(SYSTEM, 16)) == 0  # evicted first


def test_summed_statistics_take_the_hit_rate_from_counts() -> None:
    def stats(running: int, blocks: int, usage: float, hits: int, queries: int) -> EngineStatistics:
        return EngineStatistics(
            num_running_reqs=running,
            num_waiting_reqs=1,
            num_steps=10,
            num_preemptions=0,
            num_generated_tokens=5,
            num_finished_reqs=2,
            kv_cache_usage=usage,
            num_kv_blocks=blocks,
            prefix_cache_hit_rate=hits / queries,
            prefix_cache_hits=hits,
            prefix_cache_queries=queries,
        )

    total = summed_statistics([stats(1, 100, 0.5, 90, 100), stats(2, 300, 0.1, 10, 300)])
    assert total.num_running_reqs == 3 and total.num_waiting_reqs == 2
    assert total.num_kv_blocks == 400 and total.kv_cache_usage == pytest.approx(0.2)
    assert total.prefix_cache_hit_rate == pytest.approx(0.25)


# -- the door ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"data_parallel_size": 0}, r"data_parallel_size must be in \[1, 64\], got 0"),
        ({"data_parallel_routing": "random"}, "data_parallel_routing must be one of"),
        ({"data_parallel_balance_threshold": -1}, "data_parallel_balance_threshold must be"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, r"must be in \[0, 2\), got 2"),
        ({"data_parallel_size": 2, "engine_process": False}, "engine_process must be on"),
        (
            {"data_parallel_size": 2, "tensor_parallel_size": 2, "listen": "127.0.0.1:7000"},
            "listen's port must be 0",
        ),
    ],
)
def test_bad_data_parallel_flags_are_one_line_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        asyncstep.make_config("tiny-llama", **options)


def test_open_engine_and_several_api_servers_refuse_replicas() -> None:
    config = asyncstep.make_config("tiny-llama", data_parallel_size=2, **TINY)
    with pytest.raises(ConfigError, match="api_server_count must be 1"):
        check_layout(config, ServerConfig(api_server_count=2))

    async def open_one() -> None:
        async with asyncstep.open_engine(config=config):
            pass

    with pytest.raises(ConfigError, match="use open_data_parallel_engine"):
        trio.run(open_one)


def test_the_cli_takes_vllm_s_flags() -> None:
    from asyncstep import cli

    args = cli.build_parser().parse_args(
        ["serve", "--data-parallel-size", "2", "--data-parallel-routing", "round-robin"]
    )
    config = cli.config_from_args(args)
    assert config.parallel.data_parallel_size == 2
    assert config.parallel.data_parallel_routing == "round-robin"


# -- two replicas --------------------------------------------------------------


def core_pid(engine: asyncstep.Engine) -> int:
    assert isinstance(engine.core, CoreProcess) and engine.core.pid is not None
    return engine.core.pid


@pytest.mark.trio
async def test_two_replicas_serve_one_engine_s_tokens_and_outlive_one_s_death() -> None:
    async with asyncstep.open_engine("tiny-llama", engine_process=False, **TINY) as one:
        expected = [(await one.generate(p, GREEDY)).token_ids for p in PROMPTS]

    config = asyncstep.make_config(
        "tiny-llama", data_parallel_size=2, data_parallel_routing="round-robin", **TINY
    )
    async with asyncstep.open_data_parallel_engine(config) as dp:
        assert core_pid(dp.engines[0]) != core_pid(dp.engines[1])
        got: list[list[int]] = [[] for _ in PROMPTS]

        async def generate(i: int) -> None:
            got[i] = (await dp.generate(PROMPTS[i], GREEDY)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(generate, i)
        assert got == expected
        assert [s.num_finished_reqs for s in dp.replica_statistics()] == [2, 2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(dp.generate, PROMPTS[0], LONG, request_id="twice"))
            await trio.testing.wait_all_tasks_blocked()
            assert dp.replica_of("twice") is not None
            with pytest.raises(asyncstep.InvalidRequestError, match="already in flight"):
                await dp.generate(PROMPTS[0], GREEDY, request_id="twice")
            dp.abort("twice")

        # Four long streams, two on each replica; each aborted or cut where it runs.
        outcomes: dict[str, str] = {}
        started = {f"s{i}": trio.Event() for i in range(4)}

        async def stream(rid: str) -> None:
            try:
                async for chunk in dp.stream(PROMPTS[0], LONG, request_id=rid):
                    started[rid].set()
                    outcomes[rid] = str(chunk.finish_reason)
            except EngineDeadError as exc:
                outcomes[rid] = str(exc)

        async with trio.open_nursery() as nursery:
            for rid in started:
                nursery.start_soon(stream, rid)
            for event in started.values():
                await event.wait()
            owners = {rid: dp.replica_of(rid) for rid in started}
            assert sorted(owners.values()) == [0, 0, 1, 1]
            first_on_0 = next(r for r, i in owners.items() if i == 0)
            dp.abort(first_on_0)  # routed to replica 0: replica 1's streams go on
            os.kill(core_pid(dp.engines[1]), signal.SIGKILL)
            with trio.fail_after(30):
                await dp.engines[1].wait_stopped()
            for rid, owner in owners.items():
                if owner == 0:
                    dp.abort(rid)
        for rid, owner in owners.items():
            if owner == 1:
                assert outcomes[rid].startswith("data-parallel replica 1 died: request")
                assert "killed by signal SIGKILL" in outcomes[rid]
            else:
                assert outcomes[rid] == "abort", outcomes
        assert dp.error is None
        health = dp.replicas()
        assert health[0].alive and not health[1].alive
        assert health[1].error is not None and "SIGKILL" in health[1].error

        # The survivor serves on, alone; /health says who died; metrics per replica.
        assert (await dp.generate(PROMPTS[1], GREEDY)).token_ids == expected[1]
        transport = httpx.ASGITransport(app=build_app(dp))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.get("/health")
            assert response.status_code == 200
            replicas = response.json()["replicas"]
            assert [r["alive"] for r in replicas] == [True, False]
            body = {"prompt": PROMPTS[2], "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            out = await client.post("/v1/completions", json=body)
            assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 8
            metrics = (await client.get("/metrics")).text
            assert 'asyncstep:num_requests_running{model_name="tiny-llama",replica="0"}' in metrics
            assert 'vllm:num_requests_waiting{model_name="tiny-llama",replica="all"}' in metrics
