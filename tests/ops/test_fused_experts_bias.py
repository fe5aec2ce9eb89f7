"""gpt-oss's experts through :meth:`OpSet.fused_experts`: the "swigluoai"
activation and the w13 / w2 biases against a token-by-token loop written as
transformers' ``GptOssExperts`` computes (interleaved gate/up columns,
converted once by :func:`gate_up_from_interleaved`), in float32, on the
reference and the CPU op set (the sync-free every-token path too)."""

from __future__ import annotations

import pytest
import torch

from asyncstep.ops import TORCH_OPS
from asyncstep.ops.torch_moe import experts_every_token, gate_up_from_interleaved

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 24, 16, 4, 2, 9


def hf_experts(
    hidden: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """transformers' gpt-oss experts, one token and expert at a time."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = hidden[t] @ gate_up_proj[e] + gate_up_bias[e]
            gate, up = gate_up[::2].clamp(max=7.0), gate_up[1::2].clamp(-7.0, 7.0)
            glu = gate * torch.sigmoid(gate * 1.702)
            out[t] += weights[t, j] * (((up + 1) * glu) @ down_proj[e] + down_bias[e])
    return out


def case(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g) * 2  # some gates past the clamp
    gate_up_proj = torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g)
    gate_up_bias = torch.randn(EXPERTS, 2 * INTER, generator=g)
    down_proj = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * 0.2
    down_bias = torch.randn(EXPERTS, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.softmax(torch.randn(TOKENS, TOP_K, generator=g), dim=-1)
    return hidden, gate_up_proj, gate_up_bias, down_proj, down_bias, weights, ids.to(torch.int32)


def test_clamps_reached() -> None:
    hidden, gate_up_proj, *_ = case(0)
    gate_up = torch.einsum("th,ehi->tei", hidden, gate_up_proj)
    assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2].abs() > 7).any()


@pytest.mark.parametrize("path", ["torch", "cpu", "every_token"])
def test_swigluoai_with_biases_matches_transformers(path: str) -> None:
    hidden, gate_up_proj, gate_up_bias, down_proj, down_bias, weights, ids = case(1)
    expected = hf_experts(hidden, gate_up_proj, gate_up_bias, down_proj, down_bias, weights, ids)
    w13, b13 = gate_up_from_interleaved(gate_up_proj.transpose(1, 2), gate_up_bias)
    w2 = down_proj.transpose(1, 2).contiguous()
    args = (hidden, w13, w2, weights, ids, "swigluoai", b13, down_bias)
    if path == "every_token":
        got = experts_every_token(*args)
    elif path == "cpu":
        from asyncstep.ops.cpu.library import load_cpu_kernels
        from asyncstep.ops.cpu.ops import CpuOps

        kernels = load_cpu_kernels()
        if kernels is None:
            pytest.skip("the CPU library does not build here")
        got = CpuOps(kernels.layer_ops).fused_experts(*args)
    else:
        got = TORCH_OPS.fused_experts(*args)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_silu_biases_optional_and_unknown_activation_refused() -> None:
    hidden, gate_up_proj, _, down_proj, _, weights, ids = case(2)
    w13 = gate_up_proj.transpose(1, 2).contiguous()
    w2 = down_proj.transpose(1, 2).contiguous()
    plain = TORCH_OPS.fused_experts(hidden, w13, w2, weights, ids)
    zero_bias = TORCH_OPS.fused_experts(
        hidden,
        w13,
        w2,
        weights,
        ids,
        "silu",
        torch.zeros(EXPERTS, 2 * INTER),
        torch.zeros(EXPERTS, HIDDEN),
    )
    torch.testing.assert_close(plain, zero_bias, rtol=0, atol=0)
    with pytest.raises(ValueError, match="activation"):
        TORCH_OPS.fused_experts(hidden, w13, w2, weights, ids, "gelu")
