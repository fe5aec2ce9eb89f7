"""Micro-batches: where a step is cut, each half's attention metadata, and
the same tokens as whole steps (torch reference attention, on the CPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import asyncstep
from asyncstep import SamplingParams
from asyncstep.models.model_loader import LoadedModel
from asyncstep.runner.ubatching import (
    UBatchSlice,
    maybe_create_ubatch_slices,
    num_leading_decodes,
    split_host_metadata,
)
from tests.engine.test_engine import generate_all


def cut(tokens: list[int], padded: int, uniform: bool = False) -> list[UBatchSlice] | None:
    return maybe_create_ubatch_slices(
        np.array(tokens), padded, uniform_decode=uniform, decode_threshold=4, prefill_threshold=8
    )


def test_small_steps_are_not_cut() -> None:
    assert cut([1, 1, 1], 3, uniform=True) is None  # 3 decodes < 4
    assert cut([3, 4], 7) is None  # 7 prefill tokens < 8
    assert cut([1] * 4, 4, uniform=True) is not None


def test_a_request_spanning_the_cut_is_in_both_halves() -> None:
    first, second = cut([1, 1, 5, 3, 6], 16)  # type: ignore[misc]
    assert first == UBatchSlice(slice(0, 4), slice(0, 8))
    assert second == UBatchSlice(slice(3, 5), slice(8, 16))
    qsl = np.array([0, 1, 2, 7, 10, 16])
    seq_lens = np.array([10, 20, 30, 40, 50])
    a = split_host_metadata(first, qsl, seq_lens)
    # Request 3 has one query (token 7) in the first half: its keys end 2 early.
    assert a.query_start_loc.tolist() == [0, 1, 2, 7, 8]
    assert a.seq_lens.tolist() == [10, 20, 30, 38]
    b = split_host_metadata(second, qsl, seq_lens)
    assert b.query_start_loc.tolist() == [0, 2, 8] and b.seq_lens.tolist() == [40, 50]
    assert b.block_rows.tolist() == [3, 4]
    assert num_leading_decodes(a.query_start_loc) == 2


def test_a_cut_between_requests_and_padding() -> None:
    first, second = cut([4, 4], 8)  # type: ignore[misc]
    assert first == UBatchSlice(slice(0, 1), slice(0, 4))
    assert second == UBatchSlice(slice(1, 2), slice(4, 8))
    # Padded to 12: cut at 6; the second half ends at the last real token.
    first, second = cut([4, 5], 12)  # type: ignore[misc]
    assert first.token_slice == slice(0, 6) and second.token_slice == slice(6, 9)


PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [42], [5] * 20, [7, 7]]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


async def tokens(model: LoadedModel, **options: Any) -> tuple[list[list[int]], int]:
    async with asyncstep.open_engine(model, max_num_batched_tokens=24, **options) as engine:
        results = await generate_all(engine, PROMPTS, PARAMS)
        runner = engine.core.executor.runner  # type: ignore[attr-defined]
    return [r.token_ids for r in results], runner.step_inputs.num_ubatched_steps


@pytest.mark.trio
async def test_micro_batched_steps_give_the_whole_steps_tokens(tiny_model: LoadedModel) -> None:
    whole, none = await tokens(tiny_model)
    split, num_split = await tokens(
        tiny_model, enable_ubatching=True, ubatch_decode_threshold=2, ubatch_prefill_threshold=4
    )
    assert split == whole
    # The prefill steps (a request spanning the cut among them) and the decode
    # steps of 2..5 requests all ran as two micro-batches.
    assert none == 0 and num_split >= 10
