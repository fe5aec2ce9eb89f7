"""Tiny random Llama, Qwen2 and Qwen3 checkpoints, written with transformers'
``save_pretrained`` (safetensors): greedy tokens equal transformers', token
for token, in fp32 on the CPU, for prompts of different lengths batched
together and with chunked prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.hf_parity import PROMPTS, Parity, random_model, tiny_fields

PARITY = Parity(PROMPTS, max_tokens=12)


def tiny_config(arch: str) -> Any:
    import transformers

    common = tiny_fields(intermediate_size=128, num_hidden_layers=3)
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0, head_dim=16)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0)
    return transformers.Qwen3Config(**common, head_dim=32, rope_theta=10000.0)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    model = random_model(tiny_config(request.param))
    if request.param == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.mark.trio
@pytest.mark.parametrize("chunk", [2048, 4])
async def test_greedy_equals_transformers(
    checkpoint: tuple[Path, Any], chunk: int, device: torch.device
) -> None:
    path, hf_model = checkpoint
    expected = PARITY.expected(hf_model.to(device))
    options = {"device": str(device), "max_num_batched_tokens": chunk, "engine_process": True}
    assert await PARITY.serve_async(path, **options) == expected
