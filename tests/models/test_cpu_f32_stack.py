"""The CPU's float32 stack (``asyncstep.ops.cpu.f32_stack``: a stage's
layers in one call of the library) against the layer-by-layer forward it
replaces: the same greedy tokens and the same log-prob bits for prompts
decoded together (prefill, chunked prefill and decode steps), and the same
expert counts, for the mixtures of experts (Qwen3-MoE with a dense layer,
Mixtral, OLMoE's whole-width q/k norms, gpt-oss's biases, sinks and
swigluoai without its windows) and dense float32 models (Llama, Qwen3's
per-head q/k norms, Qwen2's qkv bias). The layers it declines (packed
weights, torch's matmul, tensor parallelism) keep the layer-by-layer
forward; transformers' tokens are ``test_moe``'s and ``test_gpt_oss``'s
(every float32 engine there runs the stack)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, load_model
from asyncstep.models.moe import MoeForCausalLM
from asyncstep.ops.cpu.f32_stack import CpuF32Stack
from asyncstep.ops.cpu.library import load_cpu_kernels
from tests.models.hf_parity import PROMPTS, random_model, tiny_fields
from tests.models.test_gpt_oss import tiny_config as gpt_oss_config
from tests.models.test_moe import tiny_config as moe_config

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU library does not build here"
)


def dense_config(family: str) -> Any:
    import transformers

    common = tiny_fields(num_hidden_layers=2, intermediate_size=96)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


CONFIGS = {
    "qwen3_moe": lambda: moe_config("qwen3_moe"),
    "mixtral": lambda: moe_config("mixtral"),
    "olmoe": lambda: moe_config("olmoe"),
    "gpt_oss": lambda: gpt_oss_config(sliding_window=None, layer_types=["full_attention"] * 4),
    "llama": lambda: dense_config("llama"),
    "qwen3": lambda: dense_config("qwen3"),
    "qwen2": lambda: dense_config("qwen2"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    random_model(CONFIGS[request.param]()).save_pretrained(path, safe_serialization=True)
    return path


async def greedy(loaded: LoadedModel, *, stack: bool, **options: Any) -> list[Any]:
    """Every prompt's tokens and log-probs, decoded together."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    async with asyncstep.open_engine(loaded, engine_process=False, **options) as engine:
        assert isinstance(loaded.model.model.step_path, CpuF32Stack)
        if not stack:
            loaded.model.model.step_path = None
        results: list[Any] = [None] * len(PROMPTS)

        async def one(i: int) -> None:
            out = await engine.generate(PROMPTS[i], params)
            results[i] = (out.token_ids, out.logprobs)

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    return results


def served(path: Path, *, stack: bool, **options: Any) -> tuple[list[Any], Any]:
    loaded = load_model(ModelConfig(model=str(path), device="cpu", dtype="float32"))
    results = trio.run(lambda: greedy(loaded, stack=stack, **options))
    model = loaded.model
    load = model.expert_load() if isinstance(model, MoeForCausalLM) else None
    return results, load


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 8}], ids=["whole", "chunked"])
def test_the_stack_gives_the_layers_bits(
    checkpoint: Path, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens, every log-prob and the expert counts, bit for bit (the
    stack ran every step)."""
    steps: list[int] = []
    run = CpuF32Stack.__call__

    def counted(self: CpuF32Stack, hidden: torch.Tensor, *args: Any) -> Any:
        steps.append(hidden.shape[0])
        return run(self, hidden, *args)

    monkeypatch.setattr(CpuF32Stack, "__call__", counted)
    stacked, stacked_load = served(checkpoint, stack=True, **options)
    assert len(steps) >= 12 and max(steps) > 1
    layered, layered_load = served(checkpoint, stack=False, **options)
    assert stacked == layered
    assert stacked_load == layered_load
    assert all(len(tokens) == 12 for tokens, _ in stacked)


def test_the_stack_declines_what_it_does_not_run(checkpoint: Path) -> None:
    """torch's float32 matmul (``invariant_float32`` off) or weights that
    are not float32: the layers run one by one."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    loaded = load_model(ModelConfig(model=str(checkpoint), device="cpu", dtype="float32"))
    layers = loaded.model.model.stage_layers()

    async def built() -> None:
        async with asyncstep.open_engine(loaded, engine_process=False):
            assert CpuF32Stack.build(kernels, layers) is not None
            ops = layers[0].self_attn.attn.ops.ops
            ops.invariant_float32 = False
            assert CpuF32Stack.build(kernels, layers) is None
            ops.invariant_float32 = True
            weight = layers[-1].self_attn.o_proj.weight
            weight.data = weight.data.to(torch.bfloat16)
            assert CpuF32Stack.build(kernels, layers) is None
            assert CpuF32Stack.build(kernels, []) is None

    trio.run(built)
