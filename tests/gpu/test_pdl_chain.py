"""Programmatic dependent launch over a decoder layer's kernels
(``asyncstep.ops.triton.pdl``): the add + RMSNorm, the one-row dense GEMV
(its first weight chunk loaded before it waits), the q/k norms, SiLU * up,
the routing and the alignment, the experts' small-T GEMVs and the grouped
GEMMs with their combine, chained as a mixture-of-experts layer runs them,
give the same bits launched with PDL as one after another: eagerly and in
replays of a CUDA graph (whose inputs are rewritten between replays, so a
kernel that read its input before the kernel before wrote it would show).

GPU only (compute capability 9.0 or above, ``ASYNCSTEP_TEST_DEVICE=cuda``):
off it, the launches take no PDL and there is nothing to compare.
"""

from __future__ import annotations

import os

import pytest
import torch
from cuda_graphs import captured, pdl_off_bits

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels need triton")

from asyncstep.ops.triton import pdl  # noqa: E402
from asyncstep.ops.triton.fused import fused_add_rms_norm, qk_rms_norm, silu_and_mul  # noqa: E402
from asyncstep.ops.triton.fused_moe import fused_experts  # noqa: E402
from asyncstep.ops.triton.gemv import dense_gemv  # noqa: E402
from asyncstep.ops.triton.moe_routing import topk_route  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
pytestmark = pytest.mark.skipif(
    DEVICE.type != "cuda" or not torch.cuda.is_available(),
    reason="programmatic dependent launch on the GPU",
)

HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS, EXPERTS, TOP_K, INTER = 512, 64, 8, 2, 16, 4, 256


def _layer_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM

    def w(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)

    return {
        "norm": (torch.rand(HIDDEN, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE),
        "qkv": w(qkv, HIDDEN),
        "q_norm": (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(DEVICE),
        "k_norm": (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(DEVICE),
        "o": w(HIDDEN, Q_HEADS * HEAD_DIM),
        "router": w(EXPERTS, HIDDEN, scale=0.2),
        "w13": w(EXPERTS, 2 * INTER, HIDDEN),
        "w2": w(EXPERTS, HIDDEN, INTER),
        "gate_up": w(2 * INTER, HIDDEN),
        "down": w(HIDDEN, INTER),
    }


def _layer(
    x: torch.Tensor, residual: torch.Tensor, w: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's kernels on ``x [T, HIDDEN]``: one-row steps take the GEMV,
    more rows torch's matmul (as the op set does)."""

    def linear(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dense_gemv(a, weight) if a.shape[0] == 1 else a @ weight.T

    normed, residual = fused_add_rms_norm(x, residual, w["norm"], 1e-6)
    qkv = linear(normed, w["qkv"])
    q_end, k_end = Q_HEADS * HEAD_DIM, (Q_HEADS + KV_HEADS) * HEAD_DIM
    q, k = qk_rms_norm(qkv[:, :q_end], qkv[:, q_end:k_end], w["q_norm"], w["k_norm"], 1e-6)
    attn = linear(q * 0.5, w["o"])  # a stand-in for attention: q's heads
    normed, residual = fused_add_rms_norm(attn, residual, w["norm"], 1e-6)
    logits = linear(normed, w["router"])
    weights, ids = topk_route(logits, TOP_K, renormalize=True)
    moe = fused_experts(normed, w["w13"], w["w2"], weights, ids)
    dense = linear(silu_and_mul(linear(normed, w["gate_up"])), w["down"])
    return moe + dense + k.sum(), residual


@pytest.mark.parametrize("tokens", [1, 5])
def test_pdl_leaves_a_moe_layer_s_bits_alone(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three layers, one token (the GEMVs, the small-T experts) or five
    (the alignment and the grouped GEMMs): PDL on gives PDL off's bits."""
    if not pdl.applies(torch.ones(1, device=DEVICE)):
        pytest.skip("ASYNCSTEP_PDL=0, or a GPU before compute capability 9.0")
    layers = [_layer_weights(seed) for seed in range(3)]
    gen = torch.Generator().manual_seed(7)
    x_in = (torch.randn(tokens, HIDDEN, generator=gen) * 0.5).to(torch.bfloat16).to(DEVICE)
    residual_in = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).to(DEVICE)

    def chain() -> torch.Tensor:
        x, residual = x_in, residual_in
        for w in layers:
            x, residual = _layer(x, residual, w)
        return x + residual

    expected = pdl_off_bits(chain, monkeypatch)
    graph, out = captured(chain)
    first_x, first_residual = x_in.clone(), residual_in.clone()
    for i in range(6):
        out.fill_(float("nan"))
        # odd replays on other inputs: a read of a stale input would show
        x_in.copy_(first_x if i % 2 == 0 else first_x.flip(0) * 0.5)
        residual_in.copy_(first_residual)
        graph.replay()
        torch.cuda.synchronize()
        if i % 2 == 0:
            assert torch.equal(out, expected)
    monkeypatch.setattr(pdl, "ENABLED", False)
    x_in.copy_(first_x.flip(0) * 0.5)
    other = chain()
    x_in.copy_(first_x.flip(0) * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, other)
