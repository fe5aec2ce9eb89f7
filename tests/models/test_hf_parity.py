"""Tiny random Llama, Qwen2 and Qwen3 checkpoints, written with transformers'
``save_pretrained`` (safetensors): greedy tokens equal transformers', token
for token, in fp32 on the CPU, for prompts of different lengths batched
together and with chunked prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams

MAX_TOKENS = 12
PROMPTS = [[3, 17, 92, 5], [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31], [77]]


def tiny_config(arch: str) -> Any:
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        # Larger weights than the default make the logits far from ties.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0, head_dim=16)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0)
    return transformers.Qwen3Config(**common, head_dim=32, rope_theta=10000.0)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any]:
    import transformers

    torch.manual_seed(0)
    config = tiny_config(request.param)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if request.param == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.trio
@pytest.mark.parametrize("chunk", [2048, 4])
async def test_greedy_equals_transformers(
    checkpoint: tuple[Path, Any], chunk: int, device: torch.device
) -> None:
    path, hf_model = checkpoint
    expected = [hf_greedy(hf_model.to(device), p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results: list[Any] = [None] * len(PROMPTS)
    async with asyncstep.open_engine(
        path, device=str(device), dtype="float32", max_num_batched_tokens=chunk
    ) as engine:

        async def one(i: int) -> None:
            results[i] = await engine.generate(PROMPTS[i], params)

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    assert [r.token_ids for r in results] == expected
