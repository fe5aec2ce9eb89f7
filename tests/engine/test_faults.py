"""The fault campaign of issue 14, cut to CI's size (``tests/faults.py``
runs it whole): random aborts of every kind mixed with preemption leave the
survivors' greedy tokens as they are alone, give every KV block back and
keep the engine serving; the engine core or a rank SIGKILLed under load
fails every caller with EngineDeadError within 10 s and leaves no process
behind (more kills: tests/engine/test_engine_process.py, tests/channels/test_parallel.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from asyncstep.models.model_loader import LoadedModel


@pytest.fixture
def faults() -> Any:
    import faults  # type: ignore[import-not-found]

    return faults


@pytest.mark.trio
async def test_random_aborts_with_preemption_keep_survivors_and_blocks(
    faults: Any, tiny_model: LoadedModel
) -> None:
    # 24 blocks of 4 tokens for 10 requests of up to 64 tokens: preemption
    # all along. Deadlines count tokens that the campaign's streams read
    # (no timers); the core runs in this process, so its blocks are counted.
    spec = faults.EngineSpec(tiny_model, {"block_size": 4, "num_blocks": 24})
    campaign = faults.AbortCampaign(
        num_aborts=120, num_survivor_prompts=6, clock="tokens", seed=14, timeout_s=120
    )
    report = await faults.run_abort_campaign(spec, campaign)
    assert report.failures == [] and report.survivor_mismatches == []
    assert report.num_aborts == 120
    assert all(counts["aborted"] > 0 for counts in report.by_kind.values()), report.by_kind
    assert sum(counts["finished"] for counts in report.by_kind.values()) > 0  # aborts too late
    assert report.num_preemptions > 0
    assert report.survivors_checked >= campaign.survivor_lanes
    # Once idle every block is back, no request is left, and the engine serves.
    assert report.num_free_kv_blocks == report.num_kv_blocks == 24
    assert report.blocks_held == 0 and report.requests_left == 0
    assert report.kv_cache_usage == 0.0 and report.alive_after
    assert report.ok


@pytest.mark.trio
@pytest.mark.parametrize("rank", [None, 0], ids=["core", "rank0"])
async def test_a_kill_under_load_fails_every_caller_within_10_s_and_leaves_no_process(
    faults: Any, rank: int | None
) -> None:
    """SIGKILL of the engine core, or of rank 0 (the driver rank, the store's
    server; tests/channels/test_parallel.py kills rank 1 under one stream), of a TP = 2
    engine under 8 callers, then one caller more (the late one)."""
    options = {"load_format": "dummy", "device": "cpu", "dtype": "float32"}
    spec = faults.EngineSpec("tiny-llama", {**options, "tensor_parallel_size": 2})
    result = await faults.kill_round(
        spec, 0, rank=rank, num_callers=8, max_delay_s=0.0, rng=random.Random(0)
    )
    assert result.failures == []
    victim = "the engine core process" if rank is None else f"rank {rank}"
    assert f"{victim} died (killed by signal SIGKILL)" in result.error
    assert len(result.dead_s) == 9 and result.late_s is not None
    assert max(result.dead_s) < 10 and result.exit_s < 10
    # The core and its 2 ranks: gone within 10 s of the kill.
    assert result.num_processes == 3 and result.left == []
    assert result.ok
