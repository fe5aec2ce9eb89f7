"""CUDA graphs by batch shape: the dispatcher (capture sizes, padding,
dispatch order, capture order) and the graph runner's wiring — static
buffers, padding conventions, piecewise cuts — checked on the CPU through the
stand-in graphs (a replay re-runs the captured function on the static
buffers), against eager runs of the same engine."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import asyncstep
from asyncstep import SamplingParams
from asyncstep.errors import ConfigError
from asyncstep.models.model_loader import LoadedModel
from asyncstep.runner.cudagraph_dispatcher import (
    BatchDescriptor,
    CudagraphDispatcher,
    CUDAGraphMode,
    default_capture_sizes,
)
from asyncstep.runner.cudagraph_runner import CudaGraphRunner
from asyncstep.runner.staging import StagedArena
from asyncstep.runner.step_inputs import is_arange
from tests.conftest import TEST_DEVICE
from tests.engine.test_engine import generate_all

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


def dispatcher(mode: str, **kw: Any) -> CudagraphDispatcher:
    options: dict[str, Any] = {"max_num_seqs": 64, "max_num_batched_tokens": 2048} | kw
    return CudagraphDispatcher(CUDAGraphMode.parse(mode), **options)


def test_default_capture_sizes() -> None:
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[sizes.index(256) + 1 :] == list(range(272, 513, 16))
    assert all(s % 8 == 0 for s in sizes[3 : sizes.index(256) + 1])
    # Fine steps up to 2x max_num_seqs (at most 512), then steps of 256 (chunked
    # prefills) up to the token budget (at most 4096).
    small = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=16).capture_sizes
    assert small[small.index(32) :] == [32, *range(256, 2049, 256)]
    assert dispatcher("PIECEWISE", max_num_batched_tokens=100).capture_sizes[-1] == 96
    assert dispatcher("PIECEWISE", max_num_batched_tokens=9000).capture_sizes[-1] == 4096
    assert dispatcher("PIECEWISE", max_capture_size=300).capture_sizes[-2:] == [128, 256]


def test_sizes_rounded_to_the_sequence_parallel_multiple() -> None:
    d = dispatcher("PIECEWISE", capture_sizes=[1, 2, 3, 4, 6], num_tokens_multiple=2)
    assert d.capture_sizes == [2, 4, 6]
    assert d.dispatch(3, 2, False) == (PIECEWISE, BatchDescriptor(4))


def test_batches_are_padded_to_the_next_capture_size() -> None:
    d = dispatcher("FULL_AND_PIECEWISE")
    assert d.dispatch(3, 3, True) == (FULL, BatchDescriptor(4, 4, uniform_decode=True))
    assert d.dispatch(9, 9, True) == (FULL, BatchDescriptor(16, 16, uniform_decode=True))
    # A mixed batch: PIECEWISE, padded in tokens only (its attention runs eagerly).
    assert d.dispatch(9, 3, False) == (PIECEWISE, BatchDescriptor(16))
    # Too many tokens for any graph: eager, unpadded.
    assert d.dispatch(129, 64, False) == (PIECEWISE, BatchDescriptor(256))
    assert d.dispatch(2049, 64, False) == (NONE, BatchDescriptor(2049, 64, False))


def test_dispatch_order_full_exact_then_relaxed_then_piecewise() -> None:
    full = dispatcher("FULL", max_num_seqs=8)
    # No separate decode routine: a decode batch takes the relaxed FULL graph,
    # whose request count is the most that many tokens can hold (<= max_num_seqs).
    assert full.dispatch(3, 3, True) == (FULL, BatchDescriptor(4, 4, uniform_decode=False))
    assert full.dispatch(12, 2, False) == (FULL, BatchDescriptor(16, 8, uniform_decode=False))
    both = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=8)
    assert both.dispatch(8, 8, True)[0] is FULL
    # Decode graphs stop at max_num_seqs: 16 single-token requests cannot happen,
    # but 16 tokens of mixed requests go PIECEWISE.
    assert BatchDescriptor(16, 16, True) not in both.full_keys
    assert both.dispatch(16, 5, False) == (PIECEWISE, BatchDescriptor(16))
    decode_only = dispatcher("FULL_DECODE_ONLY")
    assert decode_only.dispatch(5, 5, True)[0] is FULL
    assert decode_only.dispatch(5, 2, False) == (NONE, BatchDescriptor(5, 2, False))
    assert dispatcher("PIECEWISE").dispatch(5, 5, True) == (PIECEWISE, BatchDescriptor(8))
    assert dispatcher("NONE").dispatch(5, 5, True)[0] is NONE
    assert not dispatcher("NONE").keys_to_capture()


def test_speculative_verify_batches_get_uniform_graphs_of_their_own() -> None:
    """With k = 3 drafts a request (``uniform_decode_query_len`` 4), FULL
    graphs of 4 tokens a request beside the one-token ones, for every
    capture size up to max_num_seqs requests; a verify batch where each
    request has all its drafts is padded in requests to one; one where some
    request has fewer drafts is a mixed batch (as vLLM: the relaxed FULL
    graph, else PIECEWISE); a step without drafts is a plain decode."""
    d = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=8, uniform_decode_query_len=4)
    spec_keys = {k for k in d.full_keys if k.uniform_decode and k.num_tokens != k.num_reqs}
    assert spec_keys == {BatchDescriptor(4 * s, s, True) for s in (1, 2, 4, 8)}
    assert {k for k in d.full_keys if k.num_tokens == k.num_reqs} == {
        BatchDescriptor(s, s, True) for s in (1, 2, 4, 8)
    }
    small = dispatcher(
        "FULL_AND_PIECEWISE",
        max_num_seqs=8,
        capture_sizes=[1, 2, 4, 8, 16],
        uniform_decode_query_len=4,
    )
    # The static buffers must hold the largest graph: 8 requests of 4 tokens.
    assert small.max_capture_size == 16 and small.max_graph_tokens == 32
    assert small.dispatch(4, 1, True) == (FULL, BatchDescriptor(4, 1, True))
    assert small.dispatch(12, 3, True) == (FULL, BatchDescriptor(16, 4, True))
    assert small.dispatch(32, 8, True) == (FULL, BatchDescriptor(32, 8, True))
    assert small.dispatch(1, 1, True) == (FULL, BatchDescriptor(1, 1, True))
    assert small.dispatch(3, 3, True) == (FULL, BatchDescriptor(4, 4, True))
    # Fewer drafts somewhere: a mixed batch.
    assert small.dispatch(3, 1, False) == (PIECEWISE, BatchDescriptor(4))
    assert small.dispatch(11, 3, False) == (PIECEWISE, BatchDescriptor(16))
    relaxed = dispatcher("FULL", max_num_seqs=8, uniform_decode_query_len=4)
    assert relaxed.dispatch(3, 1, False) == (FULL, BatchDescriptor(4, 4, False))
    # FULL alone has no separate decode routine: no uniform graphs at all.
    assert relaxed.dispatch(4, 1, True) == (FULL, BatchDescriptor(4, 4, False))
    # The token budget bounds the graphs: 4 requests of 4 tokens at most.
    budget = dispatcher(
        "FULL_AND_PIECEWISE", max_num_seqs=8, max_num_batched_tokens=16, uniform_decode_query_len=4
    )
    spec_sizes = [k.num_reqs for k in budget.full_keys if k.num_tokens == 4 * (k.num_reqs or 0)]
    assert sorted(spec_sizes) == [1, 2, 4]  # type: ignore[type-var]
    assert budget.dispatch(12, 3, True) == (FULL, BatchDescriptor(16, 4, True))
    # Sequence parallelism: only sizes whose tokens are a multiple of the TP size.
    sp = dispatcher(
        "FULL_AND_PIECEWISE",
        max_num_seqs=8,
        capture_sizes=[2, 4, 8],
        num_tokens_multiple=2,
        uniform_decode_query_len=3,
    )
    assert {k for k in sp.full_keys if k.num_tokens == 3 * (k.num_reqs or 0)} == {
        BatchDescriptor(6, 2, True),
        BatchDescriptor(12, 4, True),
        BatchDescriptor(24, 8, True),
    }
    # Uniform decode keys exist only with a separate decode routine.
    assert not dispatcher("PIECEWISE", uniform_decode_query_len=4).full_keys
    with pytest.raises(ConfigError, match="uniform_decode_query_len"):
        dispatcher("FULL_AND_PIECEWISE", uniform_decode_query_len=0)


def test_keys_are_captured_largest_first() -> None:
    keys = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=8).keys_to_capture()
    sizes = [desc.num_tokens for _, desc in keys]
    assert sizes == sorted(sizes, reverse=True)
    assert {mode for mode, _ in keys} == {FULL, PIECEWISE}
    # One FULL decode graph and one PIECEWISE graph per size up to max_num_seqs.
    # Sizes 1, 2, 4, 8 twice; 16 and the 8 prefill sizes 256 .. 2048 piecewise only.
    assert len(keys) == 2 * 4 + 1 + 8


def test_mode_names_are_checked() -> None:
    with pytest.raises(ConfigError, match="cudagraph_mode must be one of"):
        CUDAGraphMode.parse("ALWAYS")
    with pytest.raises(ConfigError, match="cudagraph_mode must be one of"):
        asyncstep.CompilationConfig(cudagraph_mode="fast")
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes must be positive"):
        asyncstep.CompilationConfig(cudagraph_capture_sizes=[0, 8])
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        asyncstep.CompilationConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="max_cudagraph_capture_size must be positive"):
        asyncstep.CompilationConfig(max_cudagraph_capture_size=0)
    with pytest.raises(ConfigError, match="ubatch thresholds must be at least 2"):
        asyncstep.CompilationConfig(ubatch_decode_threshold=1)
    assert CUDAGraphMode.FULL_AND_PIECEWISE.decode_mode() is FULL
    assert CUDAGraphMode.FULL_AND_PIECEWISE.mixed_mode() is PIECEWISE
    assert CUDAGraphMode.FULL_DECODE_ONLY.mixed_mode() is NONE


# -- the graph runner, on the CPU stand-in --------------------------------

#: Real CUDA graphs on a GPU (ASYNCSTEP_TEST_DEVICE=cuda), the stand-in elsewhere.
STAND_IN = TEST_DEVICE != "cuda"
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42], [5] * 20, [7, 7]]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, ignore_eos=True)


async def run_engine(
    model: LoadedModel, *, short: bool = False, **options: Any
) -> tuple[list[Any], Any]:
    """Serve PROMPTS (greedy), then two seeded requests; ``short``: fewer
    and shorter (the Triton interpreter is slow)."""
    prompts, params = PROMPTS, PARAMS
    if short:
        prompts, params = (
            [PROMPTS[1], PROMPTS[2], PROMPTS[3]],
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        )
    async with asyncstep.open_engine(
        model,
        max_num_seqs=8,
        max_num_batched_tokens=16,  # the 20-token prompt is chunked
        cudagraph_capture_sizes=[1, 2, 4, 8, 16],
        **options,
    ) as engine:
        results = await generate_all(engine, prompts, params)
        if not short:
            results += await generate_all(engine, prompts[:2], SEEDED)
        runner = engine.core.executor.runner  # type: ignore[attr-defined]
        return [r.token_ids for r in results], runner


@pytest.mark.trio
@pytest.mark.parametrize("overlap", [True, False])
async def test_piecewise_graphs_give_the_eager_tokens(
    tiny_model: LoadedModel, overlap: bool
) -> None:
    eager, runner = await run_engine(tiny_model, cudagraph_mode="NONE", async_scheduling=overlap)
    assert set(runner.step_inputs.cudagraph_steps) == {"NONE"}
    graphed, runner = await run_engine(
        tiny_model,
        cudagraph_mode="PIECEWISE",
        cudagraph_stand_in=STAND_IN,
        async_scheduling=overlap,
    )
    assert graphed == eager
    # Mixed and decode batches of 1..5 requests all ran through the pieces
    # (5 decodes padded to 8); the graphs were released at shutdown.
    assert (
        runner.step_inputs.cudagraph_steps["PIECEWISE"] > 10
        and "NONE" not in runner.step_inputs.cudagraph_steps
    )
    assert runner.graph_runner is None


@pytest.mark.trio
async def test_full_graphs_with_triton_attention_give_the_eager_tokens(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FULL decode graphs need attention that reads only device metadata:
    the Triton kernels (interpreted on the CPU). Graphs against the same
    kernels run eagerly. Uniform decode graphs end with the logits."""
    pytest.importorskip("triton")
    with_logits: list[bool] = []
    computes_logits = CudaGraphRunner.computes_logits

    def spy(self: CudaGraphRunner, mode: CUDAGraphMode, desc: BatchDescriptor) -> bool:
        with_logits.append(computes_logits(self, mode, desc))
        assert not with_logits[-1] or desc.uniform_decode
        return with_logits[-1]

    monkeypatch.setattr(CudaGraphRunner, "computes_logits", spy)
    options: dict[str, Any] = {
        "attention_backend": "triton",
        "cudagraph_stand_in": STAND_IN,
        "short": True,
    }
    eager, _ = await run_engine(tiny_model, cudagraph_mode="NONE", **options)
    graphed, runner = await run_engine(tiny_model, cudagraph_mode="FULL_AND_PIECEWISE", **options)
    assert graphed == eager
    steps = runner.step_inputs.cudagraph_steps
    assert steps["FULL"] >= 4 and steps["PIECEWISE"] > 0 and "NONE" not in steps
    assert with_logits.count(True) == steps["FULL"]
    relaxed, runner = await run_engine(tiny_model, cudagraph_mode="FULL", **options)
    assert relaxed == eager and set(runner.step_inputs.cudagraph_steps) == {"FULL"}


# -- the graph runner's staged inputs -------------------------------------------


def test_staged_arena_regions_are_typed_disjoint_views() -> None:
    device = torch.device(TEST_DEVICE)
    arena = StagedArena(
        device,
        {
            "ids": ((5,), torch.int64),
            "lens": ((3,), torch.int32),
            "table": ((3, 4), torch.int32),
        },
    )
    assert {n: (t.shape, t.dtype) for n, t in arena.tensors.items()} == {
        "ids": ((5,), torch.int64),
        "lens": ((3,), torch.int32),
        "table": ((3, 4), torch.int32),
    }
    arena.host["ids"][:] = np.arange(5) - 2
    arena.host["lens"][:] = [7, 8, 9]
    arena.host["table"][:] = np.arange(12).reshape(3, 4)
    arena.upload("table", 2)  # the first two rows of the table
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert arena.tensors["ids"].tolist() == [-2, -1, 0, 1, 2]
    assert arena.tensors["lens"].tolist() == [7, 8, 9]
    table = arena.tensors["table"].tolist()
    assert table[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    if device.type == "cuda":  # the last row was not uploaded
        assert table[2] == [0, 0, 0, 0]


def test_is_arange() -> None:
    assert is_arange(np.array([], dtype=np.int64))
    assert is_arange(np.arange(4))
    assert not is_arange(np.array([0, 2, 1, 3]))
    assert not is_arange(np.array([1, 2, 3]))
    assert not is_arange(np.array([0, 1, 1, 3]))
