"""CUDA graphs of models with several KV cache groups (layers mixing sliding
-window and full attention): a tiny random gpt-oss (window 4, its layers
alternating) and a tiny Gemma 3 (window 8: five windowed layers, one full)
give the same greedy tokens through the graph runner as eagerly, on the
CPU stand-in (a replay re-runs the captured function on the static
buffers) or, with ``ASYNCSTEP_TEST_DEVICE=cuda``, real graphs
(``tests/gpu/test_real_graphs_kv_groups.py``).

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
import numpy as np
import pytest

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from asyncstep.models.model_loader import LoadedModel, load_model
from asyncstep.ops.attention import AttentionMetadata
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.cudagraph_dispatcher import (
    BatchDescriptor,
    CudagraphDispatcher,
    CUDAGraphMode,
)
from asyncstep.runner.cudagraph_runner import CudaGraphRunner, HostInputs
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
BLOCK_SIZE = 4
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
    #: Captured CUDA graphs ran (not the stand-in).
    real_graphs: bool


def saved_and_loaded(hf_model: Any, path: Path) -> LoadedModel:
    """A tiny random transformers model saved at ``path`` (safetensors),
    loaded here (fp32, the test device)."""
    hf_model.save_pretrained(path, safe_serialization=True)
    return load_model(ModelConfig(model=str(path), device=TEST_DEVICE, dtype="float32"))


#: Two layers, one windowed and one full: both KV cache groups at a third
#: (Gemma 3's six) or half (gpt-oss's four) of the interpreted kernels.
TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    hf_model = test_gpt_oss.tiny_model(**TWO_LAYERS)
    return saved_and_loaded(hf_model, tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    hf_model = random_model(test_gemma3.tiny_config(**TWO_LAYERS), attn_implementation="eager")
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


async def generate(
    engine: asyncstep.Engine, prompts: list[list[int]], budgets: list[int]
) -> list[list[int]]:
    """Greedy tokens of ``prompts`` submitted at once, ``budgets[i]`` for prompt ``i``."""
    tokens: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=budgets[i], ignore_eos=True)
        tokens[i] = (await engine.generate(prompts[i], params)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return tokens


async def serve(
    model: LoadedModel,
    counts: dict[str, int],
    rounds: list[list[list[int]]] | None = None,
    budgets: list[int] = MAX_TOKENS,
    **options: Any,
) -> Served:
    """Each round's prompts (default PROMPTS, then AGAIN) at once, round
    after round, with prefix caching on blocks of 4 (``options`` override)."""
    counts.update(freed=0, hits=0)
    defaults: dict[str, Any] = {
        "max_num_seqs": 8,
        "max_num_batched_tokens": 16,  # the 20-token prompt is chunked
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
    }
    options = defaults | options
    tokens: list[list[int]] = []
    async with asyncstep.open_engine(model, **options) as engine:
        runner = engine.core.executor.runner  # type: ignore[attr-defined]
        for prompts in rounds or [PROMPTS, AGAIN]:
            tokens += await generate(engine, prompts, budgets)
        graphs = runner.graph_runner
        return Served(
            tokens,
            dict(runner.step_inputs.cudagraph_steps),
            runner.kv_binding.num_groups,
            counts["freed"],
            counts["hits"],
            real_graphs=graphs is not None and not graphs.pool.stand_in,
        )


def assert_same_tokens_through_graphs(eager: Served, graphed: Served, *modes: str) -> None:
    assert graphed.tokens == eager.tokens
    assert graphed.num_kv_groups > 1 and set(graphed.cudagraph_steps) == set(modes)
    assert set(eager.cudagraph_steps) == {"NONE"}
    assert graphed.freed_windowed_blocks > 0 and eager.freed_windowed_blocks > 0
    assert graphed.prefix_cache_hit_tokens == eager.prefix_cache_hit_tokens > 0
    assert graphed.real_graphs == (not STAND_IN)


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
@pytest.mark.timeout(600)  # interpreted Triton MoE and attention, two engines
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


# -- the static buffers, directly ------------------------------------------------


def group_runner(model: LoadedModel) -> CudaGraphRunner:
    """A graph runner of 2 KV cache groups, 4 requests of 3 blocks a group."""
    dispatcher = CudagraphDispatcher(
        CUDAGraphMode.FULL_AND_PIECEWISE,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        capture_sizes=[1, 2, 4, 8],
    )
    return CudaGraphRunner(
        model.model,
        dispatcher,
        device=model.device,
        dtype=model.dtype,
        max_num_reqs=4,
        max_blocks_per_req=3,
        num_kv_groups=2,
        stand_in=True,
    )


def decode_inputs(table: BlockTable, positions: list[int], fast: bool) -> HostInputs:
    """A decode step of rows ``0 .. len(positions) - 1`` at ``positions``."""
    pos = np.array(positions, dtype=np.int64)
    r = len(positions)
    return HostInputs(
        input_ids=np.ones(r, dtype=np.int64),
        positions=pos,
        slot_mapping=table.decode_slot_mapping(pos),
        query_start_loc=np.arange(r + 1, dtype=np.int32),
        seq_lens=(pos + 1).astype(np.int32),
        block_table=table.group_table(0, r),
        block_table_source=table if fast else None,
        group_slot_mappings=[table.decode_slot_mapping(pos, 1)],
        group_block_tables=[table.group_table(1, r)],
    )


@pytest.mark.parametrize("fast", [True, False], ids=["changed rows", "whole table"])
def test_each_group_s_table_and_slots_reach_its_static_buffers(
    gemma3: LoadedModel, fast: bool
) -> None:
    """A decode of 3 requests padded to 4: each group's block table rows
    and slots in its buffers (padding slots -1 in both groups), the static
    metadata's ``kv_groups[0]`` viewing group 1's; a row that gets new
    blocks is restaged in both groups. With the persistent table at hand
    (``fast``) only its changed rows are (several groups: whatever the
    table's size), else the whole table."""
    graphs = group_runner(gemma3)
    table = BlockTable(4, 3, BLOCK_SIZE, num_groups=2)
    # Interleaved as the scheduler sends them: (group 0, group 1) per block.
    for row, ids in enumerate([[1, 2], [3, 4, 5, 6], [7, 8]]):
        table.add_row(ids, row)
    desc = BatchDescriptor(4, 4, uniform_decode=True)

    def load(positions: list[int]) -> AttentionMetadata:
        graphs.load_inputs(desc, decode_inputs(table, positions, fast), None)
        return graphs._static_meta(desc, 4, 4)

    meta = load([2, 5, 0])
    group1 = meta.kv_groups[0]
    assert len(meta.kv_groups) == 1
    assert meta.block_table[:3, :2].tolist() == [[1, 0], [3, 5], [7, 0]]
    assert group1.block_table[:3, :2].tolist() == [[2, 0], [4, 6], [8, 0]]
    assert meta.slot_mapping.tolist() == [1 * 4 + 2, 5 * 4 + 1, 7 * 4, -1]
    assert group1.slot_mapping.tolist() == [2 * 4 + 2, 6 * 4 + 1, 8 * 4, -1]
    graphs.inputs.host["block_table"][1] = -1  # what is not restaged stays
    table.append_row([9, 10], 0)  # request 0's second block in each group
    meta = load([4, 6, 1])
    group1 = meta.kv_groups[0]
    row1 = ([-1, -1], [-1, -1]) if fast else ([3, 5], [4, 6])
    assert meta.block_table[:3, :2].tolist() == [[1, 9], row1[0], [7, 0]]
    assert group1.block_table[:3, :2].tolist() == [[2, 10], row1[1], [8, 0]]
    assert group1.slot_mapping.tolist() == [10 * 4, 6 * 4 + 2, 8 * 4 + 1, -1]
