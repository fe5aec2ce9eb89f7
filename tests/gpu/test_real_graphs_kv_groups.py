"""On a CUDA device, real CUDA graphs of models with several KV cache groups
(``tests/runner/test_cudagraph_kv_groups.py``'s tiny gpt-oss and Gemma 3,
fp32): 24 prompts longer than the window, budgets from 8 to 31 tokens, so
decode batches of every size from 24 down to 1 replay FULL graphs (most
padded to a capture size: 24 -> 24, 23 -> 24, 17 -> 24, 9 -> 16, 5 -> 8,
3 -> 4), prompts chunked over PIECEWISE graphs, the windowed groups
freeing blocks of 16; then the first 8 prompts again (prefix cache hits).
Greedy tokens equal the same engine's without graphs. Run with
``ASYNCSTEP_TEST_DEVICE=cuda`` (skipped otherwise)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from asyncstep.models.model_loader import LoadedModel
from tests.conftest import TEST_DEVICE
from tests.runner.test_cudagraph_kv_groups import (
    assert_same_tokens_through_graphs,
    counted,
    gemma3,
    gpt_oss,
    serve,
)

pytestmark = pytest.mark.skipif(
    TEST_DEVICE != "cuda" or not torch.cuda.is_available(),
    reason="needs CUDA and ASYNCSTEP_TEST_DEVICE=cuda",
)
__all__ = ["counted", "gemma3", "gpt_oss"]  # the fixtures, shared

_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(1, 256, int(n)).tolist() for n in _rng.integers(10, 41, 24)]
BUDGETS = [8 + i for i in range(24)]
ROUNDS = [PROMPTS, PROMPTS[:8]]


@pytest.mark.trio
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3"])
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE"])
async def test_real_graphs_give_the_eager_tokens(
    family: str, mode: str, request: pytest.FixtureRequest, counted: dict[str, int]
) -> None:
    model: LoadedModel = request.getfixturevalue(family)
    options: dict[str, Any] = {
        "max_num_seqs": 32,
        "max_num_batched_tokens": 256,
        "block_size": 16,
        "cudagraph_capture_sizes": None,  # the default sizes: 1, 2, 4, 8, 16, 24, ...
    }
    eager = await serve(model, counted, ROUNDS, BUDGETS, cudagraph_mode="NONE", **options)
    graphed = await serve(model, counted, ROUNDS, BUDGETS, cudagraph_mode=mode, **options)
    modes = ("FULL", "PIECEWISE") if mode == "FULL_AND_PIECEWISE" else ("PIECEWISE",)
    assert_same_tokens_through_graphs(eager, graphed, *modes)
    assert graphed.cudagraph_steps[modes[0]] >= 24
