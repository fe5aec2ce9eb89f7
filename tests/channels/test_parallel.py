"""Tensor and pipeline parallelism through the engine, every rank its own
process (gloo on the CPU): each layout gives the single rank's greedy tokens;
a dying or failing rank takes everything down quickly with its error named;
impossible layouts are refused before any process starts; ranks started the
torchrun way join an engine that waits for them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
from distributed import free_port

import asyncstep
from asyncstep import ConfigError, EngineDeadError, SamplingParams
from asyncstep.channels.framing import SECRET_ENV
from asyncstep.engine.core.engine_core import EngineCore
from asyncstep.engine.executor.remote import RemoteRanks
from asyncstep.nursery.rank_main import FAULT_ENV

PROMPTS = [[5, 9, 2], list(range(40, 80)), [7] * 17, [200, 3, 99, 14, 8, 61, 1, 2, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
#: Small steps: the 40-token prompt is prefilled in chunks.
ENGINE = dict(device="cpu", dtype="float32", max_num_batched_tokens=16, num_blocks=64)


@pytest.fixture(scope="module")
def peaked_llama(peaked_llama_checkpoint: tuple[Path, Any]) -> Path:
    """The shared tiny Llama far from ties (conftest): layouts cannot flip a token."""
    return peaked_llama_checkpoint[0]


async def generate_all(
    engine: asyncstep.Engine, prompts: list[Any], params: SamplingParams
) -> list[list[int]]:
    results: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = (await engine.generate(prompts[i], params)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return results


@pytest.fixture(scope="module")
def single_rank_tokens(peaked_llama: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with asyncstep.open_engine(peaked_llama, **ENGINE) as engine:
            return await generate_all(engine, PROMPTS, GREEDY)

    return trio.run(run)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone for our purposes only once reaped; the engine reaps its children.
    return False


@pytest.mark.trio
@pytest.mark.parametrize(
    "tp,pp,sp,graphs",
    [
        (2, 1, False, False),
        (2, 1, True, False),
        (1, 2, False, False),
        (2, 2, False, False),
        (2, 2, True, False),
        (1, 2, False, True),
        (2, 2, True, True),
    ],
    ids=["tp2", "tp2-sp", "pp2", "pp2xtp2", "pp2xtp2-sp", "pp2-graphs", "pp2xtp2-sp-graphs"],
)
async def test_layout_matches_single_rank(
    peaked_llama: Path,
    single_rank_tokens: list[list[int]],
    tp: int,
    pp: int,
    sp: bool,
    graphs: bool,
    tmp_path: Path,
) -> None:
    """``graphs``: every step through (stand-in) piecewise CUDA graphs on each
    rank: static received tensors on the second stage, SP-padded sizes."""
    log = tmp_path / "ranks.jsonl"
    options: dict[str, Any] = {}
    if graphs:
        options = {
            "cudagraph_mode": "PIECEWISE",
            "cudagraph_stand_in": True,
            "rank_log_json": str(log),
        }
    # TP = 2 alone keeps the engine core in this process, to read its ranks'
    # weight sizes; every other layout runs it in its own process (the default).
    in_process = tp == 2 and pp == 1
    async with asyncstep.open_engine(
        peaked_llama,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        sequence_parallel=sp,
        engine_process=not in_process,
        **ENGINE,
        **options,
    ) as engine:
        pids = engine.rank_pids
        assert len(pids) == tp * pp
        assert await generate_all(engine, PROMPTS, GREEDY) == single_rank_tokens
        if in_process:
            # Weight memory per rank: about 1 / (tp * pp) of the model, plus replicated norms.
            assert isinstance(engine.core, EngineCore)
            assert isinstance(engine.core.executor, RemoteRanks)
            per_rank = [r.weight_bytes for r in engine.core.executor.ready]
    assert all(_gone(pid) for pid in pids)
    if graphs:  # every rank captured its graphs
        for rank in range(tp * pp):
            events = await anyio.Path(f"{log}.rank{rank}").read_text()
            assert '"cuda graphs captured"' in events and '"PIECEWISE"' in events
            # Each step's arrival is marked (the engine-to-rank hop's end).
            assert '"name":"step_in"' in events
    if in_process:
        whole = sum(per_rank) / 2 * 2  # two halves of each sharded weight
        assert max(per_rank) < 0.55 * whole


@pytest.mark.trio
async def test_bfloat16_layout_gives_with_the_cpu_kernels_what_torch_gives(
    peaked_llama: Path,
) -> None:
    """bf16 with its float32 residual stream on pp2 x tp2 with sequence
    parallelism: the CPU library's add + RMSNorm on each rank's token shard
    (the second stage's on the residual it received) and silu * up give the
    tokens torch's ops give on the same layout. (The reference is the layout,
    not one rank: bf16 partial sums of sharded matmuls round otherwise.)"""
    layout: dict[str, Any] = {
        **ENGINE,
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "sequence_parallel": True,
    }
    tokens = []
    for fused in (False, True):
        async with asyncstep.open_engine(peaked_llama, fused_kernels=fused, **layout) as engine:
            tokens.append(await generate_all(engine, PROMPTS, GREEDY))
    assert tokens[0] == tokens[1]


@pytest.mark.trio
@pytest.mark.parametrize("tp,pp", [(1, 2), (3, 1)], ids=["pp2", "tp3"])
async def test_smollm2_layouts_match_single_rank(smollm2: Any, tp: int, pp: int) -> None:
    """fp32 dense weights, as the single rank (the ``smollm2`` fixture): a
    bf16 layout's matmuls round with the thread count, which the ranks adapt
    to the load, so only fp32 is compared token for token."""
    questions = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Hi")]
    params = SamplingParams(temperature=0, max_tokens=12)
    async with asyncstep.open_engine(smollm2, max_num_batched_tokens=32) as engine:
        expected = await generate_all(engine, questions, params)
    async with asyncstep.open_engine(
        None,
        device="cpu",
        dtype="float32",
        weight_packing="none",
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=32,
    ) as engine:
        assert await generate_all(engine, questions, params) == expected


@pytest.mark.trio
async def test_a_killed_rank_brings_everything_down(peaked_llama: Path) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        async with asyncstep.open_engine(peaked_llama, tensor_parallel_size=2, **ENGINE) as engine:
            pids = engine.rank_pids
            started = time.monotonic()
            with pytest.raises(EngineDeadError, match=r"rank 1 died \(killed by signal SIGKILL\)"):
                async for chunk in engine.stream(PROMPTS[1], long):
                    if chunk.token_ids:
                        os.kill(pids[1], signal.SIGKILL)
            assert time.monotonic() - started < 10
    assert all(_gone(pid) for pid in pids)


@pytest.mark.trio
async def test_a_rank_that_raises_brings_everything_down(
    peaked_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:3")  # rank 1 (stage 1) raises in step 3
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 failed: RuntimeError: injected fault"):
        async with asyncstep.open_engine(
            peaked_llama, tensor_parallel_size=1, pipeline_parallel_size=2, **ENGINE
        ) as engine:
            pids = engine.rank_pids
            with pytest.raises(EngineDeadError, match="injected fault in rank 1 at step 3"):
                await engine.generate(PROMPTS[1], GREEDY)
    assert time.monotonic() - started < 30  # spawn and load included
    assert all(_gone(pid) for pid in pids)


@pytest.mark.trio
@pytest.mark.parametrize(
    "options,message",
    [
        (dict(tensor_parallel_size=3), "does not divide the model's attention heads"),
        (dict(tensor_parallel_size=4), "does not divide the model's key/value heads"),
        (dict(pipeline_parallel_size=5), "larger than the layer count"),
        (dict(tensor_parallel_size=2, listen="nowhere"), "listen must be HOST:PORT"),
    ],
)
async def test_impossible_layouts_are_refused_before_any_process_starts(
    peaked_llama: Path, options: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_spawn(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(anyio, "open_process", no_spawn)
    with pytest.raises(ConfigError, match=message):
        async with asyncstep.open_engine(peaked_llama, **{**ENGINE, **options}):
            pass


def _torchrun(port: int, nproc: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(free_port()),
            "-m",
            "asyncstep.rank",
            "--engine",
            f"127.0.0.1:{port}",
        ],
    )


def _start_rank(port: int, rank: int, world: int, master_port: int) -> subprocess.Popen[bytes]:
    """A rank started the way torchrun starts it: everything in the environment."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "asyncstep.rank", "--engine", f"127.0.0.1:{port}"], env=env
    )


@pytest.mark.trio
async def test_ranks_started_by_torchrun_join_the_engine(
    peaked_llama: Path, single_rank_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/parallelism.md's multi-machine recipe, on one machine: torchrun starts the
    ranks (``-m asyncstep.rank``), the engine waits for them; both sides
    have the secret in their environment."""
    monkeypatch.setenv(SECRET_ENV, "the secret of this test")
    port = free_port()
    torchrun = _torchrun(port, nproc=2)
    try:
        async with asyncstep.open_engine(
            peaked_llama,
            pipeline_parallel_size=2,
            launch_ranks=False,
            listen=f"127.0.0.1:{port}",
            **ENGINE,
        ) as engine:
            assert await generate_all(engine, PROMPTS, GREEDY) == single_rank_tokens
        assert torchrun.wait(timeout=30) == 0
    finally:
        torchrun.kill()
        torchrun.wait()


@pytest.mark.trio
async def test_a_rank_of_the_wrong_world_is_refused(
    peaked_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstep.errors import RankError

    monkeypatch.setenv(SECRET_ENV, "the secret of this test")
    port = free_port()
    stray = _start_rank(port, 0, 3, free_port())
    try:
        with pytest.raises(
            RankError, match=r"rank 0 of world 3 connected; this engine runs 2 ranks"
        ):
            async with asyncstep.open_engine(
                peaked_llama,
                tensor_parallel_size=2,
                launch_ranks=False,
                listen=f"127.0.0.1:{port}",
                **ENGINE,
            ):
                pass
    finally:
        stray.kill()
        stray.wait()


@pytest.mark.trio
async def test_whole_tensor_sends_between_stages_match_single_rank(
    peaked_llama: Path, single_rank_tokens: list[list[int]]
) -> None:
    """``pp_tensor_lanes=False``: each TP rank sends its whole tensors to the
    next stage (no slicing, no all-gather); the tokens stay the single rank's."""
    async with asyncstep.open_engine(
        peaked_llama,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pp_tensor_lanes=False,
        **ENGINE,
    ) as engine:
        assert engine.config.parallel.pp_tensor_lanes is False
        assert await generate_all(engine, PROMPTS, GREEDY) == single_rank_tokens
