"""CUDA graphs of models with several KV cache groups (layers mixing sliding
-window and full attention): a tiny random gpt-oss (window 4, its layers
alternating) and a tiny Gemma 3 (window 8: five windowed layers, one full)
give the same greedy tokens through the graph runner as eagerly, on the
CPU stand-in (a replay re-runs the captured function on the static
buffers) or, with ``ASYNCSTEP_TEST_DEVICE=cuda``, real graphs
(``tests/gpu/test_cudagraph_kv_groups.py``).

Each run serves prompts longer than the window (with blocks of 4 tokens the
windowed group frees blocks: counted) whose budgets differ, so decode
batches of 5, 4, 3, 2 and 1 requests run (5 and 3 padded to the capture
sizes 8 and 4), a 20-token prompt chunked; then, with prefix caching, the
same prompts again and one that extends a served one (hits: counted).
PIECEWISE graphs run the op set's attention eagerly between them (the CPU
kernel; the torch reference, whose decode plan is per group); FULL decode
graphs need the Triton kernels (interpreted on the CPU), whose every
layer reads its group's static block table and slots inside the graph."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from asyncstep.models.model_loader import LoadedModel, load_model
from tests.conftest import TEST_DEVICE
from tests.models import test_gemma3, test_gpt_oss
from tests.models.hf_parity import random_model

#: Real CUDA graphs on a GPU (ASYNCSTEP_TEST_DEVICE=cuda), the stand-in elsewhere.
STAND_IN = TEST_DEVICE != "cuda"
PROMPTS = [
    [3, 17, 92, 5, 250, 7, 7, 41, 99, 123, 8],
    [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31, 18, 77, 140, 3, 9, 21, 60, 2, 33],
    [77, 5, 9, 200, 14, 14, 150, 61, 8],
    [42, 42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 19, 18],
]
#: Each prompt's budget: the decode batch shrinks from 5 requests to 1.
MAX_TOKENS = [10, 8, 6, 4, 12]
#: The second round (prefix caching): the first prompts again, and one
#: extending the second by tokens of its own.
AGAIN = [PROMPTS[0], PROMPTS[1] + [5, 6, 7, 8, 9], PROMPTS[2]]


@dataclass
class Served:
    """An engine's tokens, and what its run did."""

    tokens: list[list[int]]
    cudagraph_steps: dict[str, int]
    num_kv_groups: int
    freed_windowed_blocks: int
    prefix_cache_hit_tokens: int


def saved_and_loaded(hf_model: Any, path: Path) -> LoadedModel:
    """A tiny random transformers model saved at ``path`` (safetensors),
    loaded here (fp32, the test device)."""
    hf_model.save_pretrained(path, safe_serialization=True)
    return load_model(ModelConfig(model=str(path), device=TEST_DEVICE, dtype="float32"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return saved_and_loaded(test_gpt_oss.tiny_model(), tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    hf_model = random_model(test_gemma3.tiny_config(), attn_implementation="eager")
    return saved_and_loaded(hf_model, tmp_path_factory.mktemp("gemma3"))


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Windowed blocks freed and prefix cache hit tokens, over every
    :class:`HybridKVCacheManager` of the test."""
    counts = {"freed": 0, "hits": 0}
    free_skipped = HybridKVCacheManager._free_skipped_blocks
    computed_blocks = HybridKVCacheManager.get_computed_blocks

    def freeing(self: HybridKVCacheManager, request_id: str, *args: Any) -> None:
        before = sum(self._num_freed[request_id])
        free_skipped(self, request_id, *args)
        counts["freed"] += sum(self._num_freed[request_id]) - before

    def hitting(self: HybridKVCacheManager, request: Any) -> tuple[list[int], int]:
        blocks, num_computed = computed_blocks(self, request)
        counts["hits"] += num_computed
        return blocks, num_computed

    monkeypatch.setattr(HybridKVCacheManager, "_free_skipped_blocks", freeing)
    monkeypatch.setattr(HybridKVCacheManager, "get_computed_blocks", hitting)
    yield counts


async def generate(engine: asyncstep.Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of ``prompts`` submitted at once (budgets ``MAX_TOKENS``)."""
    tokens: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
        tokens[i] = (await engine.generate(prompts[i], params)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return tokens


async def serve(
    model: LoadedModel, counts: dict[str, int], *, rounds: int = 2, **options: Any
) -> Served:
    """PROMPTS, then (``rounds`` 2) AGAIN with prefix caching, on blocks of 4."""
    counts.update(freed=0, hits=0)
    async with asyncstep.open_engine(
        model,
        max_num_seqs=8,
        max_num_batched_tokens=16,  # the 20-token prompt is chunked
        block_size=4,
        enable_prefix_caching=True,
        cudagraph_capture_sizes=[1, 2, 4, 8, 16],
        **options,
    ) as engine:
        tokens = await generate(engine, PROMPTS)
        if rounds > 1:
            tokens += await generate(engine, AGAIN)
        runner = engine.core.executor.runner  # type: ignore[attr-defined]
        return Served(
            tokens,
            dict(runner.step_inputs.cudagraph_steps),
            runner.kv_binding.num_groups,
            counts["freed"],
            counts["hits"],
        )


def assert_same_tokens_through_graphs(eager: Served, graphed: Served, *modes: str) -> None:
    assert graphed.tokens == eager.tokens
    assert graphed.num_kv_groups > 1 and set(graphed.cudagraph_steps) == set(modes)
    assert set(eager.cudagraph_steps) == {"NONE"}
    assert graphed.freed_windowed_blocks > 0 and eager.freed_windowed_blocks > 0
    assert graphed.prefix_cache_hit_tokens == eager.prefix_cache_hit_tokens > 0


@pytest.mark.trio
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
async def test_piecewise_graphs_give_the_eager_tokens(
    family: str, backend: str, request: pytest.FixtureRequest, counted: dict[str, int]
) -> None:
    model: LoadedModel = request.getfixturevalue(family)
    options: dict[str, Any] = {"attention_backend": backend, "cudagraph_stand_in": STAND_IN}
    eager = await serve(model, counted, cudagraph_mode="NONE", **options)
    graphed = await serve(model, counted, cudagraph_mode="PIECEWISE", **options)
    assert_same_tokens_through_graphs(eager, graphed, "PIECEWISE")
    assert graphed.cudagraph_steps["PIECEWISE"] > 20


@pytest.mark.trio
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
async def test_full_decode_graphs_with_triton_attention_give_the_eager_tokens(
    family: str, request: pytest.FixtureRequest, counted: dict[str, int]
) -> None:
    """FULL decode graphs (mixed batches PIECEWISE), against the same
    Triton kernels run eagerly."""
    pytest.importorskip("triton")
    model: LoadedModel = request.getfixturevalue(family)
    options: dict[str, Any] = {"attention_backend": "triton", "cudagraph_stand_in": STAND_IN}
    eager = await serve(model, counted, cudagraph_mode="NONE", **options)
    graphed = await serve(model, counted, cudagraph_mode="FULL_AND_PIECEWISE", **options)
    assert_same_tokens_through_graphs(eager, graphed, "FULL", "PIECEWISE")
    assert graphed.cudagraph_steps["FULL"] > 10
