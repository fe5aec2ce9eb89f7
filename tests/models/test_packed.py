"""Weights packed for small CPU steps (``asyncstep.ops.packed``):
4-bit weights are packed only when that is lossless (Q4_0 and Q4_1 grids),
the packed matmuls equal the dense ones on the same weights, layers switch
to their dense weight above ``max_tokens``, and the embedded model packs
every linear layer as int4 and its Q8_0 LM head as int8."""

from __future__ import annotations

import pytest
import torch
from gguf_weights import q4_0_weight, q4_1_weight

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, cpu_blocks, load_model, pack_weights
from asyncstep.ops import TORCH_OPS
from asyncstep.ops.packed import (
    GROUP_SIZE,
    is_int8_blocks,
    pack_int4,
    pack_int8_rows,
)


@pytest.mark.parametrize("make", [q4_1_weight, q4_0_weight], ids=["q4_1", "q4_0"])
def test_4_bit_weights_pack_losslessly(make: object) -> None:
    weight = make(64, 128)  # type: ignore[operator]
    packed = pack_int4(weight, torch.float32, max_tokens=8)
    assert packed is not None and packed.kind == "int4"
    x = torch.randn(5, 128)
    torch.testing.assert_close(packed.mm(x), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_mix_of_q4_0_and_q4_1_blocks_packs() -> None:
    weight = torch.cat([q4_1_weight(32, 128), q4_0_weight(32, 128)])
    packed = pack_int4(weight, torch.float32, max_tokens=8)
    assert packed is not None
    x = torch.randn(3, 128)
    torch.testing.assert_close(packed.mm(x), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(64, 128),  # not on a 4-bit grid
        q4_1_weight(64, 128).double(),  # not float32
        q4_1_weight(64, 96)[:, :80],  # columns not a multiple of the group
    ],
    ids=["dense", "float64", "ragged"],
)
def test_weights_that_are_not_4_bit_are_not_packed(weight: torch.Tensor) -> None:
    assert pack_int4(weight.contiguous(), torch.float32, max_tokens=8) is None


def test_one_value_off_the_grid_keeps_the_weight_dense() -> None:
    weight = q4_1_weight(64, 128)
    weight[7, 33] += 1e-3
    assert pack_int4(weight, torch.float32, max_tokens=8) is None


def test_bfloat16_scales_stay_close_to_the_dense_product() -> None:
    weight = q4_1_weight(128, 256)
    packed = pack_int4(weight, torch.bfloat16, max_tokens=8)
    assert packed is not None and packed.scales.dtype == torch.bfloat16
    x = torch.randn(4, 256)
    out = packed.mm(x.bfloat16()).float()
    ref = x @ weight.T
    # bf16 rounds the inputs, scales, zeros and outputs (8 bits of mantissa).
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()


def test_int8_rows_of_an_8_bit_weight() -> None:
    d = (torch.rand(256, 4, 1) * 0.01).half().float()
    q = torch.randint(-127, 128, (256, 4, GROUP_SIZE)).float()
    q[..., 0] = 127
    weight = (d * q).reshape(256, 128)
    assert is_int8_blocks(weight)
    assert not is_int8_blocks(torch.randn(256, 128))
    packed = pack_int8_rows(weight, torch.float32, max_tokens=8)
    x = torch.randn(2, 128)
    ref = x @ weight.T
    # One scale per row: each value moves at most half its row's step.
    step = weight.abs().amax(dim=1) / 127
    bound = x.abs().sum(dim=1, keepdim=True) * step / 2 + 1e-5
    assert ((packed.mm(x) - ref).abs() <= bound).all()


def test_layers_use_the_packed_weight_up_to_max_tokens_only() -> None:
    weight = q4_1_weight(64, 128)
    packed = pack_int4(weight, torch.float32, max_tokens=4)
    assert packed is not None
    calls = []
    mm = packed.mm
    packed.mm = lambda x: calls.append(x.shape[0]) or mm(x)  # type: ignore[method-assign]
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(
            TORCH_OPS.linear(x, weight, packed), x @ weight.T, rtol=1e-5, atol=1e-5
        )
    assert calls == [1, 4]


@pytest.fixture(scope="module")
def packed_smollm2() -> LoadedModel:
    """The embedded model in fp32 with its packed weights, packed by hand:
    the loader keeps an explicit float32 model dense, and fp32 scales keep
    the packed product comparable with the dense one."""
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"))
    assert all(getattr(m, "packed", None) is None for m in loaded.model.modules())
    pack_weights(loaded.model, torch.float32, max_tokens=8)
    return loaded


def test_the_embedded_model_packs_every_linear_and_its_lm_head(
    packed_smollm2: LoadedModel, smollm2: LoadedModel
) -> None:
    layers = packed_smollm2.model.model.stage_layers()
    linears = [
        m
        for layer in layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    # The CPU library's Q4 / Q8 blocks where its vector build runs, else torch's.
    blocks = cpu_blocks()
    layer_kind, head_kind = ("q4_cpu", "q8_cpu") if blocks else ("int4", "int8")
    assert all(m.packed is not None and m.packed.kind == layer_kind for m in linears)
    lm_head = packed_smollm2.model.lm_head
    assert lm_head is not None and lm_head.packed is not None
    assert lm_head.packed.kind == head_kind
    assert all(m.packed is None for m in smollm2.model.modules() if hasattr(m, "packed"))
    # The dense weights are the same either way.
    torch.testing.assert_close(
        layers[3].mlp.down_proj.weight,
        smollm2.model.model.stage_layers()[3].mlp.down_proj.weight,
        rtol=0,
        atol=0,
    )


QUESTIONS = ["What is the capital of France?", "Name three colors.", "Hi"]
#: Largest difference of a top log-prob, packed against dense (the int8 LM
#: head rounds each weight to its row's grid: ~0.01 on these logits).
LOGPROB_TOLERANCE = 0.05


async def greedy_with_logprobs(loaded: LoadedModel) -> list[asyncstep.Completion]:
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    async with asyncstep.open_engine(loaded, max_model_len=512) as engine:
        return [await engine.generate([{"role": "user", "content": q}], params) for q in QUESTIONS]


@pytest.mark.trio
async def test_packed_decode_equals_the_dense_reference(
    packed_smollm2: LoadedModel, smollm2: LoadedModel
) -> None:
    """Decode steps (one token each: the packed weights) give the dense
    reference's greedy tokens on prompts without near ties, and the same
    log-probs within LOGPROB_TOLERANCE."""
    packed = await greedy_with_logprobs(packed_smollm2)
    dense = await greedy_with_logprobs(smollm2)
    for p, d in zip(packed, dense, strict=True):
        assert p.token_ids == d.token_ids
        assert p.logprobs is not None and d.logprobs is not None
        for lp, ld in zip(p.logprobs, d.logprobs, strict=True):
            assert lp.token_ids == ld.token_ids
            diffs = [abs(a - b) for a, b in zip(lp.logprobs, ld.logprobs, strict=True)]
            assert max(diffs) <= LOGPROB_TOLERANCE
