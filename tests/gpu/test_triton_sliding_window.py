"""The Triton attention ops with a sliding window against dense windowed
attention in float64: decodes mixed with prompt chunks, a decode-only batch
(which leaves the split-KV kernels for the query-tiled one), the blocks
before each request's window poisoned; the batch-invariant op both ways
(split programs + combine, and the tile loop). On the CPU under the Triton
interpreter (``TRITON_INTERPRET=1``, set before triton is imported);
``ASYNCSTEP_TEST_DEVICE=cuda`` compiles them for the GPU (the steps built on
the CPU, moved there; the reference on the CPU)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels need triton")

from asyncstep.ops.triton.invariant_attention import (  # noqa: E402
    TritonInvariantAttention,
    invariant_paged_attention,
)
from asyncstep.ops.triton.paged_attention import TritonAttention  # noqa: E402
from tests.models.test_cpu_attention import PagedStep, make_step  # noqa: E402
from tests.models.test_sliding_window_ops import (  # noqa: E402
    COMPUTED,
    QUERY_LENS,
    poison_freed_blocks,
    run_op,
    windowed_dense,
    windowed_step,
)

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)


def on_device(step: PagedStep) -> PagedStep:
    """``step`` with its tensors on the test's device (the ``*_cpu`` ones
    stay: the ops read them on the host)."""
    meta = step.meta
    for field in dataclasses.fields(meta):
        value = getattr(meta, field.name)
        if isinstance(value, torch.Tensor) and not field.name.endswith("_cpu"):
            setattr(meta, field.name, value.to(DEVICE))
    tensors = {name: getattr(step, name).to(DEVICE) for name in ("q", "k", "v", "kv_cache")}
    return dataclasses.replace(step, **tensors)


def run_on_device(op: object, step: PagedStep, window: int) -> torch.Tensor:
    """The op's output on ``step`` (moved to the device), back on the CPU."""
    return run_op(op, on_device(step), window).cpu()


@pytest.mark.parametrize(("window", "block"), [(8, 4), (5, 4), (1, 4)])
def test_mixed_batch_matches_dense_windowed_attention(window: int, block: int) -> None:
    step = windowed_step(torch.float32, window, block)
    expected = windowed_dense(step, window)
    out = run_on_device(TritonAttention(rotates=False), step, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_decode_batch_matches_dense_windowed_attention() -> None:
    window, block = 6, 4
    num = sum(n == 1 for n in QUERY_LENS)
    step = make_step(
        [1] * num, COMPUTED[:num], heads=6, kv_heads=2, dim=32, block=block,
        dtype=torch.float32, seed=4,
    )  # fmt: skip
    poison_freed_blocks(step, window, block, COMPUTED[:num])
    expected = windowed_dense(step, window)
    out = run_on_device(TritonAttention(rotates=False), step, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("parallel", [True, False])
def test_invariant_attention_matches_dense_windowed_attention(parallel: bool) -> None:
    window, block = 5, 4
    step = windowed_step(torch.float32, window, block)
    expected = windowed_dense(step, window)
    step = on_device(step)
    run_op(TritonInvariantAttention(), step, window)  # stores the keys, attends
    meta = step.meta
    out = invariant_paged_attention(
        step.q.view(len(step.q), step.heads, step.dim),
        step.kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        step.scale,
        parallel=parallel,
        sliding_window=window,
    )
    torch.testing.assert_close(out.flatten(1).double().cpu(), expected, atol=1e-4, rtol=1e-4)
