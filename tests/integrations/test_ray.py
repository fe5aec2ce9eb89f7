"""asyncstep on a local Ray cluster (one machine, loopback): ranks as Ray
actors give the single rank's greedy tokens (fp32, TP = 2 and PP = 2), and
a rank that raises ends the engine with its error;
docs/ray.md's Ray Serve application (its block, as it is), two replicas of
two ranks each, answers the ``openai`` client's chat (streamed, with a tool
call) and, shut down, leaves no replica, engine core, rank actor or
placement group behind.

Without a cluster: importing the integration imports neither ray nor torch,
and a layout the model cannot take is refused before Serve starts. One Ray
cluster for the module's other tests: three logical CPUs, a rank and a Serve
replica asking half a CPU each (two replicas and their four ranks fit)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import ray
import trio
from distributed import free_port
from processes import alive, wait_for

import asyncstep
from asyncstep import ConfigError, EngineDeadError, SamplingParams
from asyncstep.integrations.ray import RayPlacement, build_serve_app, open_ray_engine
from asyncstep.nursery.rank_main import FAULT_ENV

PROMPTS = [[5, 9, 2], list(range(40, 80)), [7] * 17]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, num_blocks=64)
#: Half a CPU a rank, and as much for a Serve replica: Ray's accounting only.
HALF = RayPlacement(cpus_per_rank=0.5)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",  # a new cluster of this test's, whatever else runs here
        num_cpus=3,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=128 << 20,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def peaked_llama(peaked_llama_checkpoint: tuple[Path, Any]) -> Path:
    return peaked_llama_checkpoint[0]


async def generate_all(engine: asyncstep.Engine) -> list[list[int]]:
    results: list[Any] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        results[i] = (await engine.generate(PROMPTS[i], GREEDY)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return results


@pytest.fixture(scope="module")
def single_rank_tokens(peaked_llama: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with asyncstep.open_engine(peaked_llama, engine_process=False, **ENGINE) as engine:
            return await generate_all(engine)

    return trio.run(run)


def rank_actors() -> list[str]:
    """The states of every rank actor the cluster has known (from its GCS:
    the state API needs the dashboard)."""
    from ray._private.state import actors

    return [a["State"] for a in actors().values() if a["ActorClassName"] == "RankWorker"]


def test_importing_the_integration_imports_neither_ray_nor_torch() -> None:
    code = (
        "import sys, asyncstep.integrations.ray.serve, asyncstep.integrations.ray.ranks; "
        "print(sorted({'ray', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_layout_the_model_cannot_take_is_refused_before_serve_starts() -> None:
    with pytest.raises(ConfigError, match="does not divide the model's attention heads"):
        build_serve_app(tensor_parallel_size=2, device="cpu")  # SmolLM2-135M: 9 heads


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_ranks_as_ray_actors_give_the_single_rank_tokens(
    ray_cluster: None,
    peaked_llama: Path,
    single_rank_tokens: list[list[int]],
    layout: dict[str, int],
) -> None:
    async def run() -> list[list[int]]:
        async with open_ray_engine(peaked_llama, placement=HALF, **layout, **ENGINE) as engine:
            return await generate_all(engine)

    assert trio.run(run) == single_rank_tokens
    assert set(rank_actors()) == {"DEAD"}


def test_a_failing_ray_rank_ends_the_engine_with_its_error(
    ray_cluster: None, peaked_llama: Path
) -> None:
    """A rank's error reaches the engine over the control plane, as from a
    rank process; its actors are gone after."""
    placement = RayPlacement(cpus_per_rank=0.5, rank_env={FAULT_ENV: "1:2"})

    async def run() -> None:
        async with open_ray_engine(
            peaked_llama, placement=placement, pipeline_parallel_size=2, **ENGINE
        ) as engine:
            with pytest.raises(EngineDeadError, match="injected fault in rank 1 at step 2"):
                await engine.generate(PROMPTS[1], GREEDY)

    with pytest.raises(EngineDeadError, match="rank 1 failed: RuntimeError: injected fault"):
        trio.run(run)
    wait_for(lambda: set(rank_actors()) == {"DEAD"}, "the ranks to end", 60)


def docs_example(marker: str) -> str:
    """The Python block of docs/ray.md that holds ``marker``."""
    page = (Path(__file__).parents[2] / "docs" / "ray.md").read_text()
    (code,) = [b for b in re.findall(r"^```python\n(.*?)^```", page, re.S | re.M) if marker in b]
    return code


def chat_with_a_tool(url: str) -> tuple[dict[str, Any], str | None]:
    """One streamed chat that must call ``get_weather``: its arguments, and
    the finish reason."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    arguments, finish = "", None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            assert call.function is None or call.function.name in (None, "get_weather")
            arguments += (call.function and call.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    return json.loads(arguments), finish


def test_a_serve_app_of_two_replicas_answers_chats_and_tears_down(ray_cluster: None) -> None:
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    namespace: dict[str, Any] = {}
    exec(docs_example("build_serve_app("), namespace)  # docs/ray.md's app, as it is
    app = namespace["app"]
    pids: dict[int, int | None] = {}
    try:
        handle = serve.run(app, name="asyncstep", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        for _ in range(2):
            arguments, finish = chat_with_a_tool(url)
            assert finish == "tool_calls" and isinstance(arguments["city"], str)

        def both_replicas_seen() -> bool:
            replica, core = handle.pids.remote().result().values()
            pids[replica] = core
            return len(pids) == 2

        wait_for(both_replicas_seen, "both replicas to answer", timeout_s=60)
        assert rank_actors().count("ALIVE") == 4
    finally:
        serve.shutdown()
    for replica, core in pids.items():
        wait_for(lambda r=replica: not alive(r), f"replica {replica} to end", timeout_s=60)
        if core is not None:
            wait_for(lambda c=core: not alive(c), f"engine core {core} to end", timeout_s=60)
    wait_for(lambda: set(rank_actors()) == {"DEAD"}, "the ranks to end", 60)
    groups = ray.util.placement_group_table().values()
    assert all(group["state"] == "REMOVED" for group in groups)
