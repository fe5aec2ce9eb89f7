"""Sliding-window models against transformers: a tiny random Mistral
(``sliding_window`` on every layer) and a tiny Qwen3 mixing sliding and full
layers (``layer_types``), written with ``save_pretrained``; greedy tokens
equal transformers' in fp32 on the CPU for prompts longer than the window,
generating well past it, with whole and chunked prefill and small blocks
(so the KV cache manager frees the windowed layers' early blocks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from tests.gguf_weights import q4_0_weight

WINDOW = 8
MAX_TOKENS = 32
PROMPTS = [
    [3, 17, 92, 5, 250, 7, 7, 41, 99, 123, 8],
    [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31, 18, 77, 140, 3, 9, 21, 60, 2, 33],
    [77, 5, 9, 200, 14, 14, 150, 61, 8],
]


def tiny_config(arch: str) -> Any:
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        initializer_range=0.2,  # logits far from ties
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        rope_theta=10000.0,
    )
    if arch == "mistral":
        return transformers.MistralConfig(**common, head_dim=16)
    return transformers.Qwen3Config(
        **common,
        head_dim=16,
        use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention"] + ["sliding_attention"] * 2,
    )


#: Config changes that make every layer of the checkpoint attend in full.
NO_WINDOW: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "qwen3": {"layer_types": ["full_attention"] * 4},
}


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The checkpoint, transformers' greedy tokens, and its tokens with every
    layer in full attention (which must differ: the window matters)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(request.param), attn_implementation="eager"
    ).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    full = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", **NO_WINDOW[request.param]
    ).eval()
    return path, [hf_greedy(model, p) for p in PROMPTS], [hf_greedy(full, p) for p in PROMPTS]


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


async def generate_all(engine: Any, params: SamplingParams) -> list[list[int]]:
    """Every prompt's tokens, the prompts submitted at once."""
    results: list[Any] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        results[i] = await engine.generate(PROMPTS[i], params)

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    return [r.token_ids for r in results]


@pytest.mark.trio
@pytest.mark.parametrize(
    ("chunk", "block_size", "num_blocks", "backend"),
    [(2048, 16, None, "auto"), (5, 4, 53, "auto"), (5, 4, 53, "torch")],
)
async def test_greedy_equals_transformers(
    checkpoint: tuple[Path, list[list[int]], list[list[int]]],
    chunk: int,
    block_size: int,
    num_blocks: int | None,
    backend: str,
) -> None:
    """Twice over: the second round's prompts hit the prefix cache. With 53
    blocks of 4 tokens the mixed model's three requests do not fit at once
    (each group holds its own blocks): some are preempted and recomputed.
    ``auto`` is the CPU library's attention where it builds; ``torch`` the
    reference."""
    path, expected, full_attention = checkpoint
    assert all(e != f for e, f in zip(expected, full_attention, strict=True))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with asyncstep.open_engine(
        path,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=chunk,
        block_size=block_size,
        num_blocks=num_blocks,
        attention_backend=backend,
    ) as engine:
        for _ in range(2):
            assert await generate_all(engine, params) == expected
        stats = engine.statistics()
    assert stats.prefix_cache_hit_rate > 0
    if num_blocks is not None and path.name.startswith("qwen3"):
        assert stats.num_preemptions > 0


@pytest.mark.trio
async def test_the_cpu_decode_stack_keeps_the_window(tmp_path: Path) -> None:
    """The CPU library's decoder stack (packed weights) passes each layer's
    window to its attention: the windowed Mistral's tokens through the stack
    equal its layer-by-layer tokens (the same packed weights)."""
    import transformers

    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model, pack_weights
    from asyncstep.ops.cpu.decode_stack import CpuDecodeStack
    from asyncstep.ops.cpu.quant import quant_matmul

    matmul = quant_matmul()
    if matmul is None or not matmul.fast:
        pytest.skip("the stack runs on the vector build only (AVX512-VNNI or AVX2)")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("mistral"))
    for layer in model.model.layers:  # weights a Q4_0 GGUF would hold: packable
        for linear in (*vars(layer.self_attn)["_modules"].values(), *layer.mlp.children()):
            if isinstance(linear, torch.nn.Linear):
                linear.weight.data = q4_0_weight(*linear.weight.shape)
    model.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    pack_weights(loaded.model, torch.float32, max_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = []
    for stack in (True, False):
        async with asyncstep.open_engine(loaded, block_size=4) as engine:
            assert isinstance(loaded.model.model.step_path, CpuDecodeStack)
            if not stack:
                loaded.model.model.step_path = None
            tokens.append(await generate_all(engine, params))
    assert tokens[0] == tokens[1]
    assert all(len(t) == MAX_TOKENS for t in tokens[0])
