"""The Triton attention ops with attention sinks (gpt-oss) against dense
attention in float64 whose softmax has each head's sink logit in its
denominator: the query-tiled kernel on decodes mixed with prompt chunks,
windowed or not; the split-KV decode kernels with one segment and several
(the sink is segment 0's); the fused decode's store-and-attend against its
two calls; the batch-invariant op both ways (split programs + combine,
and the tile loop: the same bits), a query's bits however its request
comes; sinks of moderate and of huge (+/- 1e4) magnitude, 3 query heads
a KV head. On the CPU under the Triton interpreter (``TRITON_INTERPRET=1``,
set before triton is imported); ``ASYNCSTEP_TEST_DEVICE=cuda`` compiles
them for the GPU."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels need triton")

from asyncstep.ops.attention import AttentionShape  # noqa: E402
from asyncstep.ops.triton import attention as triton_attention  # noqa: E402
from asyncstep.ops.triton import invariant_attention  # noqa: E402
from asyncstep.ops.triton.attention import rotary_store_and_attend  # noqa: E402
from asyncstep.ops.triton.invariant_attention import (  # noqa: E402
    TritonInvariantAttention,
    invariant_paged_attention,
)
from asyncstep.ops.triton.paged_attention import TritonAttention  # noqa: E402
from tests.gpu.test_triton_sliding_window import on_device  # noqa: E402
from tests.models.test_attention_sinks_ops import SINKS, dense_with_sinks  # noqa: E402
from tests.models.test_cpu_attention import PagedStep, make_step  # noqa: E402
from tests.models.test_fused_decode import decode_step, rotary_cache  # noqa: E402
from tests.models.test_sliding_window_ops import windowed_step  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

TOL = {"atol": 1e-4, "rtol": 1e-4}


def run_op(op: object, step: PagedStep, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """The op's output on ``step`` (moved to the device), back on the CPU."""
    step = on_device(step)
    shape = AttentionShape(
        step.heads, step.k.shape[1] // step.dim, step.dim, step.scale, window, sinks.to(DEVICE)
    )
    out = op(step.q, step.k, step.v, step.kv_cache, step.meta, shape, None)  # type: ignore[operator]
    return out.cpu()


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("op", ["triton", "triton-invariant"])
def test_mixed_batch_matches_dense_attention_with_sinks(
    op: str, window: int | None, sinks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes and prompt chunks over cached prefixes (the query-tiled
    kernel; the invariant op's split programs, 32 keys a split)."""
    monkeypatch.setattr(invariant_attention, "SPLIT_KEYS", 32)
    step = windowed_step(torch.float32, window or 10_000, 4)
    attention = TritonAttention(rotates=False) if op == "triton" else TritonInvariantAttention()
    out = run_op(attention, step, window, SINKS[sinks])
    torch.testing.assert_close(out.double(), dense_with_sinks(step, window, SINKS[sinks]), **TOL)


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_batch_matches_dense_attention_with_sinks(
    num_splits: int, sinks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split-KV kernels: one segment (written to ``out``) and three
    (only segment 0 starts from the sink; the combine as ever)."""
    choose = triton_attention._decode_launch
    monkeypatch.setattr(
        triton_attention,
        "_decode_launch",
        lambda *a: dataclasses.replace(choose(*a), num_splits=num_splits),
    )
    step = make_step(
        [1, 1, 1, 1], [3, 70, 33, 100], heads=6, kv_heads=2, dim=32, block=4,
        dtype=torch.float32, seed=6,
    )  # fmt: skip
    out = run_op(TritonAttention(rotates=False), step, None, SINKS[sinks])
    torch.testing.assert_close(out.double(), dense_with_sinks(step, None, SINKS[sinks]), **TOL)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_fused_decode_takes_the_sinks(num_splits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Store-and-attend in the split-KV kernel gives its two calls' output
    (which the test above checks against dense attention)."""
    choose = triton_attention._decode_launch
    monkeypatch.setattr(
        triton_attention,
        "_decode_launch",
        lambda *a: dataclasses.replace(choose(*a), num_splits=num_splits),
    )
    heads, kv_heads, dim = 6, 2, 32
    step = decode_step([0, 32, 200, 47], 0, heads, kv_heads, dim, seed=num_splits)
    cos_sin = rotary_cache(256, dim)

    def attend(uniform: bool, sinks: torch.Tensor | None) -> torch.Tensor:
        qkv, kv_cache = step["qkv"].clone(), step["kv_cache"].clone()
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        metadata = ("slot_mapping", "query_start_loc", "seq_lens", "block_table")
        return rotary_store_and_attend(
            step["positions"], q, k, v, cos_sin, kv_cache, *(step[name] for name in metadata),
            dim**-0.5, uniform_decode=uniform, sinks=sinks,
        )  # fmt: skip

    sinks = SINKS["moderate"].to(DEVICE)
    outs = [attend(True, sinks), attend(False, sinks)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    without = attend(True, None)
    assert not torch.allclose(outs[0], without, atol=1e-3)  # the sinks count


def invariant(step: PagedStep, window: int | None, *, parallel: bool) -> torch.Tensor:
    """The invariant attention of ``step``'s queries (keys already stored)."""
    n = step.meta.num_actual_tokens
    return (
        invariant_paged_attention(
            step.q.view(n, step.heads, step.dim).to(DEVICE),
            step.kv_cache.to(DEVICE),
            step.meta.query_start_loc.to(DEVICE),
            step.meta.seq_lens.to(DEVICE),
            step.meta.block_table.to(DEVICE),
            step.scale,
            parallel=parallel,
            sliding_window=window,
            sinks=SINKS["huge"].to(DEVICE),
        )
        .flatten(1)
        .cpu()
    )


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.usefixtures("row_wise_interpreted_dot")  # bit for bit under the interpreter
def test_invariant_rows_with_sinks_keep_their_bits(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both launches give the same bits; a prompt chunk's last row gives
    the bits of the same position's decode in another step."""
    monkeypatch.setattr(invariant_attention, "SPLIT_KEYS", 32)
    layout = {"query_lens": [1, 9, 1], "computed": [40, 61, 7]}
    step = make_step(**layout, heads=6, kv_heads=2, dim=32, block=4, dtype=torch.float32, seed=7)
    full_k, full_v = step.full_k, step.full_v
    for r, k in enumerate(full_k):  # every key in the cache (a decode reads them all)
        pos = torch.arange(k.shape[0])
        slots = step.meta.block_table[r, pos // 4].long() * 4 + pos % 4
        step.kv_cache.view(2, 2, -1, 32)[0][:, slots] = k.transpose(0, 1)
        step.kv_cache.view(2, 2, -1, 32)[1][:, slots] = full_v[r].transpose(0, 1)
    split_programs = invariant(step, window, parallel=True)
    assert torch.equal(invariant(step, window, parallel=False), split_programs)
    torch.testing.assert_close(
        split_programs.double(), dense_with_sinks(step, window, SINKS["huge"]), **TOL
    )
    # Request 1's last query (position 69) as a decode among other decodes.
    decode = dataclasses.replace(step, q=step.q[[0, 9, 10]])
    meta = dataclasses.replace(
        step.meta,
        num_actual_tokens=3,
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
    )
    decode = dataclasses.replace(decode, meta=meta)
    out = invariant(decode, window, parallel=True)
    assert torch.equal(out[1], split_programs[9])


@pytest.mark.parametrize(
    "sinks",
    [torch.zeros(SINKS["moderate"].numel() + 1), torch.zeros(SINKS["moderate"].numel(), 1)],
    ids=["a head too many", "two dimensions"],
)
def test_sinks_the_kernels_cannot_read_are_refused_in_one_line(sinks: torch.Tensor) -> None:
    step = windowed_step(torch.float32, 10_000, 4)
    with pytest.raises(ValueError, match=r"^sinks must be \d+ floating-point logits") as err:
        run_op(TritonAttention(rotates=False), step, None, sinks)
    assert "\n" not in str(err.value)
