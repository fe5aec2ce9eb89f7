"""The experts of a mixture-of-experts layer (:meth:`OpSet.fused_experts`)
against a token-by-token loop of each token's experts, in float32: tokens
routed to every expert, to some experts only, one expert each, none at all;
an intermediate dimension split in two slices sums to the whole (tensor
parallelism); the CPU op set gives the reference's result bit for bit. And
the router (:func:`select_experts`): softmax or sigmoid top-k, renormalised
or not, as transformers' routers compute it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncstep.models.layers.moe import select_experts
from asyncstep.ops import TORCH_OPS
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.torch_moe import experts_every_token

HIDDEN, INTER, EXPERTS = 48, 40, 5


def weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    return w13, w2


def routing(
    tokens: int, top_k: int, experts: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden rows, each routed to ``top_k`` distinct experts of ``experts``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    choices = torch.tensor(experts)
    ids = torch.zeros(tokens, top_k, dtype=torch.long)
    for t in range(tokens):
        ids[t] = choices[torch.randperm(len(experts), generator=g)[:top_k]]
    topk_weights = torch.rand(tokens, top_k, generator=g)
    return hidden, topk_weights, ids.to(torch.int32)


def per_token(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    inter = w2.shape[2]
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e] @ hidden[t]
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += topk_weights[t, j] * (w2[e] @ act)
    return out


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"),
    [
        (1, 2, list(range(EXPERTS))),
        (37, 2, list(range(EXPERTS))),
        (16, 2, [0, 3]),  # experts 1, 2 and 4 get no token
        (9, 1, [4]),  # one expert takes every token
        (0, 2, list(range(EXPERTS))),
    ],
)
def test_fused_experts_is_each_tokens_weighted_experts(
    tokens: int, top_k: int, experts: list[int]
) -> None:
    w13, w2 = weights(0)
    hidden, topk_weights, topk_ids = routing(tokens, top_k, experts, seed=tokens)
    got = TORCH_OPS.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    assert got.shape == (tokens, HIDDEN) and got.dtype == torch.float32
    torch.testing.assert_close(got, per_token(hidden, w13, w2, topk_weights, topk_ids))


def test_intermediate_slices_sum_to_the_whole() -> None:
    """Tensor parallelism: each rank's slice of every expert's intermediate
    dimension gives a partial sum; the sums add up to the whole's result."""
    w13, w2 = weights(1)
    hidden, topk_weights, topk_ids = routing(20, 2, list(range(EXPERTS)), seed=1)
    whole = TORCH_OPS.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    half = INTER // 2
    parts = []
    for rank in range(2):
        rows = torch.cat(
            [
                w13[:, rank * half : (rank + 1) * half],
                w13[:, INTER + rank * half : INTER + (rank + 1) * half],
            ],
            dim=1,
        )
        parts.append(
            TORCH_OPS.fused_experts(
                hidden, rows, w2[:, :, rank * half : (rank + 1) * half], topk_weights, topk_ids
            )
        )
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_bfloat16_experts_round_once() -> None:
    w13, w2 = weights(2)
    hidden, topk_weights, topk_ids = routing(12, 2, list(range(EXPERTS)), seed=2)
    got = TORCH_OPS.fused_experts(
        hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), topk_weights, topk_ids
    )
    assert got.dtype == torch.bfloat16
    want = per_token(
        hidden.bfloat16().float(),
        w13.bfloat16().float(),
        w2.bfloat16().float(),
        topk_weights,
        topk_ids,
    )
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_cpu_op_set_gives_the_reference_experts() -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU library does not build here")
    from asyncstep.ops.cpu.ops import CpuOps

    w13, w2 = weights(3)
    hidden, topk_weights, topk_ids = routing(25, 2, list(range(EXPERTS)), seed=3)
    expected = TORCH_OPS.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    # Weights the library's experts do not take (not contiguous): torch's
    # F.linear under the grouped matmul, the reference's bits.
    strided = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert not strided.is_contiguous() and torch.equal(strided, w13)
    ops = CpuOps(kernels.layer_ops, invariant_float32=False)
    want = TORCH_OPS.fused_experts(hidden, strided, w2, topk_weights, topk_ids)
    assert torch.equal(ops.fused_experts(hidden, strided, w2, topk_weights, topk_ids), want)
    # the library's float32 matmul (one K order for every row count): its sums
    got = CpuOps(kernels.layer_ops).fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_unknown_activation_is_refused() -> None:
    w13, w2 = weights(4)
    hidden, topk_weights, topk_ids = routing(3, 2, list(range(EXPERTS)), seed=4)
    with pytest.raises(ValueError, match="unsupported activation 'gelu'"):
        TORCH_OPS.fused_experts(hidden, w13, w2, topk_weights, topk_ids, "gelu")


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_is_transformers(renormalize: bool) -> None:
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(5))
    topk_weights, topk_ids = select_experts(logits, 3, renormalize=renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    want, want_ids = torch.topk(probs, 3, dim=-1)
    if renormalize:
        want /= want.sum(dim=-1, keepdim=True)
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    assert torch.equal(topk_ids, want_ids.to(torch.int32))
    assert torch.equal(topk_weights, want)
    sums = topk_weights.sum(dim=-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones(30))
    else:
        assert (sums < 1).all()


def test_sigmoid_router() -> None:
    logits = torch.randn(10, 6, generator=torch.Generator().manual_seed(6))
    topk_weights, topk_ids = select_experts(logits, 2, renormalize=False, scoring_func="sigmoid")
    want, want_ids = torch.topk(torch.sigmoid(logits), 2, dim=-1)
    assert torch.equal(topk_ids, want_ids.to(torch.int32))
    assert torch.equal(topk_weights, want)
    with pytest.raises(ValueError, match="unsupported router scoring"):
        select_experts(logits, 2, renormalize=False, scoring_func="tanh")


def test_cpu_bfloat16_experts_are_batch_invariant() -> None:
    """Through the library's dense bfloat16 matmul (``invariant_dense``) a
    token's output is the same alone and in a batch that sends its experts
    other rows."""
    from asyncstep.ops.cpu.dense import dense_matmul

    kernels = load_cpu_kernels()
    if kernels is None or dense_matmul() is None:
        pytest.skip("the CPU library's dense matmul does not build here")
    from asyncstep.ops.cpu.ops import CpuOps

    ops = CpuOps(kernels.layer_ops, invariant_dense=True)
    w13, w2 = (w.bfloat16() for w in weights(5))
    hidden, topk_weights, topk_ids = routing(40, 2, list(range(EXPERTS)), seed=5)
    hidden = hidden.bfloat16()
    batch = ops.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    for t in (0, 17, 39):
        one = ops.fused_experts(
            hidden[t : t + 1], w13, w2, topk_weights[t : t + 1], topk_ids[t : t + 1]
        )
        assert torch.equal(one[0], batch[t])


def test_the_sync_free_form_gives_the_same_sums() -> None:
    """What a CUDA graph captures (every expert over every token, weight 0
    where not picked) equals the sorted form, tokens without experts' rows
    included."""
    w13, w2 = weights(6)
    hidden, topk_weights, topk_ids = routing(21, 2, [1, 2, 4], seed=6)
    torch.testing.assert_close(
        experts_every_token(hidden, w13, w2, topk_weights, topk_ids),
        TORCH_OPS.fused_experts(hidden, w13, w2, topk_weights, topk_ids),
    )
