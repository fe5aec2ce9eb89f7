"""The dense weights a packed CPU model drops (:mod:`asyncstep.models.dense_weights`):
the default's decoder projections, served by the library's blocks at every
step, hold no dense weight (the tied embedding keeps its own) and the model
still answers; with ``packed_max_tokens`` small (big steps take the dense
weights) they are kept; the packed-weights cache stores none of the dropped
ones, and an entry lacking a dense weight this machine needs is rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.dense_weights import EVERY_STEP, dense_16_bit
from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncstep.models.layers.moe import FusedMoE
from asyncstep.models.model_loader import LoadedModel, cpu_blocks, load_model
from asyncstep.ops.cpu.quant import CpuQuantWeight

pytestmark = pytest.mark.skipif(
    not cpu_blocks(), reason="the library's blocks serve no step here: every weight stays dense"
)


def projections(loaded: LoadedModel) -> list[ColumnParallelLinear | RowParallelLinear]:
    return [
        m
        for layer in loaded.model.model.stage_layers()
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]


@pytest.mark.trio
async def test_the_default_s_projections_hold_no_dense_weight_and_it_answers(
    smollm2_default: LoadedModel,
) -> None:
    layers = projections(smollm2_default)
    assert layers and all(m.weight.numel() == 0 for m in layers)
    assert all(m.packed is not None and m.packed.max_tokens == EVERY_STEP for m in layers)
    head, embed = smollm2_default.model.lm_head, smollm2_default.model.model.embed_tokens
    assert head is not None and embed is not None and head.weight is embed.weight
    arch = smollm2_default.arch_config
    assert embed.weight.shape == (arch.vocab_size, arch.hidden_size)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    async with asyncstep.open_engine(smollm2_default) as engine:
        out = await engine.generate(question, SamplingParams(temperature=0, max_tokens=12))
    assert "Paris" in out.text


def test_a_small_packed_max_tokens_keeps_the_dense_weights() -> None:
    loaded = load_model(ModelConfig(device="cpu", packed_max_tokens=16), with_tokenizer=False)
    layers = projections(loaded)
    arch = loaded.arch_config
    assert all(m.packed is not None and m.packed.max_tokens == 16 for m in layers)
    assert all(m.weight.shape[1] in (arch.hidden_size, arch.intermediate_size) for m in layers)


def test_the_cache_stores_no_dropped_weight_and_rebuilds_where_one_is_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCSTEP_CACHE_DIR", str(tmp_path))
    built = load_model(ModelConfig(device="cpu"), with_tokenizer=False)
    [entry] = (tmp_path / "weights").glob("*.safetensors")
    with open(entry, "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    dropped = json.loads(header["__metadata__"]["dropped"])
    names = {f"{n}.weight" for n, m in built.model.named_modules() if m in projections(built)}
    assert set(dropped) == names and not names & header.keys()
    # A CPU whose library does not run: the entry lacks what it needs, so the
    # model is packed again, its dense weights kept (and the entry rewritten).
    monkeypatch.setattr(CpuQuantWeight, "runs_here", lambda self: False)
    rebuilt = load_model(ModelConfig(device="cpu"), with_tokenizer=False)
    layers = projections(rebuilt)
    assert all(m.weight.numel() > 0 and m.packed is not None for m in layers)
    down = rebuilt.model.model.stage_layers()[0].mlp.down_proj.weight
    assert down.dtype == torch.float32 and down.abs().sum() > 0


def test_dense_16_bit_asks_for_16_bit_weights_no_packed_copy_and_no_experts() -> None:
    """What CUDA's default ``batch_invariant`` asks of a model."""
    loaded = load_model(
        ModelConfig(model="tiny-llama", load_format="dummy", device="cpu", dtype="bfloat16"),
        with_tokenizer=False,
    )
    model = loaded.model
    assert dense_16_bit(model, torch.bfloat16) and dense_16_bit(model, torch.float16)
    assert not dense_16_bit(model, torch.float32)
    head = model.lm_head
    assert head is not None and head.packed is None
    head.packed = object()  # type: ignore[assignment]  # a packed copy (the LM head's Q8)
    assert not dense_16_bit(model, torch.bfloat16)
    head.packed = None
    model.model.layers[0].mlp = FusedMoE(2, 64, 64, bias=False)
    assert not dense_16_bit(model, torch.bfloat16)
