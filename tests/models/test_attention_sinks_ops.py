"""Attention sinks (gpt-oss) op by op: the torch reference and the CPU op
set's attention (which runs the reference for such layers) against dense
attention in float64 whose softmax has each head's sink logit in its
denominator (transformers' ``eager_attention_forward``), with and without
a sliding window, decodes mixed with prompt chunks; the Triton ops and the
CPU decode stack decline such layers."""

from __future__ import annotations

import pytest
import torch

from asyncstep.models.layers.attention import plan_decode_buckets
from asyncstep.ops.attention import AttentionShape
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.paged_attention import CpuAttention
from asyncstep.ops.torch_attention import TORCH_ATTENTION
from tests.models.test_cpu_attention import PagedStep
from tests.models.test_sliding_window_ops import windowed_step

HEADS = 6


def sinks() -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, HEADS)


def dense_with_sinks(step: PagedStep, window: int | None) -> torch.Tensor:
    qsl, outs = step.meta.query_start_loc_cpu, []
    for r, (k, v) in enumerate(zip(step.full_k, step.full_v, strict=True)):
        q = step.q[qsl[r] : qsl[r + 1]].double().view(-1, step.heads, step.dim)
        group = step.heads // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * step.scale
        q_len, seq = q.shape[0], k.shape[0]
        ones = torch.ones(q_len, seq, dtype=torch.bool)
        mask = ones.tril(seq - q_len)
        if window is not None:
            mask &= ones.triu(seq - q_len - window + 1)
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks().double().view(-1, 1, 1).expand(-1, q_len, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v).flatten(1))
    return torch.cat(outs)


def run(op: object, step: PagedStep, window: int | None, planned: bool) -> torch.Tensor:
    shape = AttentionShape(
        step.heads, step.k.shape[1] // step.dim, step.dim, step.scale, window, sinks()
    )
    meta = step.meta
    if planned:
        meta.decode_buckets = plan_decode_buckets(
            meta.seq_lens_cpu[: meta.num_decodes], meta.block_table, step.kv_cache.shape[3], 2, 1
        )
    return op(step.q, step.k, step.v, step.kv_cache, meta, shape, None)  # type: ignore[operator]


@pytest.mark.parametrize("window", [None, 8, 5])
@pytest.mark.parametrize("op_name", ["torch", "cpu"])
def test_sinks_match_dense_attention(op_name: str, window: int | None) -> None:
    step = windowed_step(torch.float32, window or 10_000, 4)
    if op_name == "torch":
        op: object = TORCH_ATTENTION
    else:
        kernels = load_cpu_kernels()
        if kernels is None:
            pytest.skip("the CPU kernels do not build here (no C compiler)")
        op = CpuAttention(kernels.attention)
    out = run(op, step, window, planned=op_name == "torch")
    expected = dense_with_sinks(step, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
