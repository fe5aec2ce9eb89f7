"""Sliding-window models against transformers: a tiny random Mistral
(``sliding_window`` on every layer) and a tiny Qwen3 mixing sliding and full
layers (``layer_types``), written with ``save_pretrained``; greedy tokens
equal transformers' in fp32 on the CPU for prompts longer than the window,
generating well past it, with whole and chunked prefill and small blocks
(so the KV cache manager frees the windowed layers' early blocks). The
Mistral also with PP = 2 x TP = 2 (gloo), and from a GGUF (``llama`` with
``sliding_window``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncstep
from tests.gguf_weights import q4_0_weight
from tests.models.hf_parity import LONG_PROMPTS, Parity, random_model, tiny_fields, write_hf_gguf

WINDOW = 8
PARITY = Parity(LONG_PROMPTS)


def tiny_config(arch: str) -> Any:
    import transformers

    common = tiny_fields(
        intermediate_size=128,
        num_hidden_layers=4,
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

#: The checkpoint, transformers' greedy tokens, and its tokens with every
#: layer in full attention (which must differ: the window matters).
WindowedCheckpoint = tuple[Path, list[list[int]], list[list[int]]]


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], WindowedCheckpoint]:
    """An architecture's windowed checkpoint, made once per module."""
    import transformers

    made: dict[str, WindowedCheckpoint] = {}

    def get(arch: str) -> WindowedCheckpoint:
        if arch not in made:
            model = random_model(tiny_config(arch), attn_implementation="eager")
            path, expected = PARITY.save(model, tmp_path_factory.mktemp(arch))
            full = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", **NO_WINDOW[arch]
            ).eval()
            made[arch] = path, expected, PARITY.expected(full)
        return made[arch]

    return get


@pytest.fixture(scope="module", params=["mistral", "qwen3"])
def checkpoint(
    request: pytest.FixtureRequest, checkpoints: Callable[[str], WindowedCheckpoint]
) -> WindowedCheckpoint:
    return checkpoints(request.param)


@pytest.mark.trio
@pytest.mark.parametrize(
    ("chunk", "block_size", "num_blocks", "backend"),
    [(2048, 16, None, "auto"), (5, 4, 53, "auto"), (5, 4, 53, "torch")],
)
async def test_greedy_equals_transformers(
    checkpoint: WindowedCheckpoint,
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
            assert await PARITY.generate_all(engine) == expected
        stats = engine.statistics()
    assert stats.prefix_cache_hit_rate > 0
    if num_blocks is not None and path.name.startswith("qwen3"):
        assert stats.num_preemptions > 0


def test_mistral_with_pp2xtp2_equals_transformers(
    checkpoints: Callable[[str], WindowedCheckpoint],
) -> None:
    """The windowed Mistral on 4 ranks (PP = 2 x TP = 2, gloo, a process a
    rank): every stage's layers keep the window and free the blocks before
    it; transformers' tokens past the window."""
    path, expected, _ = checkpoints("mistral")
    layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "block_size": 4}
    assert PARITY.serve(path, **layout) == expected


def test_a_mistral_gguf_keeps_the_window(
    checkpoints: Callable[[str], WindowedCheckpoint], tmp_path: Path
) -> None:
    """The windowed Mistral as llama.cpp's converter writes it (architecture
    ``llama``, q/k rows permuted, ``llama.attention.sliding_window``):
    every layer slides, and the tokens are transformers'."""
    from asyncstep.models.loader.gguf import GGUFCheckpoint

    path, expected, _ = checkpoints("mistral")
    gguf = write_hf_gguf(tmp_path / "mistral.gguf", path, "llama", sliding_window=WINDOW)
    assert GGUFCheckpoint(gguf).arch_config().layer_windows == (WINDOW,) * 4
    assert PARITY.serve(gguf, block_size=4) == expected


@pytest.mark.trio
async def test_the_cpu_decode_stack_keeps_the_window(tmp_path: Path) -> None:
    """The CPU library's decoder stack (packed weights) passes each layer's
    window to its attention: the windowed Mistral's tokens through the stack
    equal its layer-by-layer tokens (the same packed weights)."""
    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model, pack_weights
    from asyncstep.ops.cpu.decode_stack import CpuDecodeStack
    from asyncstep.ops.cpu.quant import quant_matmul

    matmul = quant_matmul()
    if matmul is None or not matmul.fast:
        pytest.skip("the stack runs on the vector build only (AVX512-VNNI or AVX2)")
    model = random_model(tiny_config("mistral"))
    for layer in model.model.layers:  # weights a Q4_0 GGUF would hold: packable
        for linear in (*vars(layer.self_attn)["_modules"].values(), *layer.mlp.children()):
            if isinstance(linear, torch.nn.Linear):
                linear.weight.data = q4_0_weight(*linear.weight.shape)
    model.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    pack_weights(loaded.model, torch.float32, max_tokens=8)
    tokens = []
    for stack in (True, False):
        async with asyncstep.open_engine(loaded, block_size=4) as engine:
            assert isinstance(loaded.model.model.step_path, CpuDecodeStack)
            if not stack:
                loaded.model.model.step_path = None
            tokens.append(await PARITY.generate_all(engine))
    assert tokens[0] == tokens[1]
    assert all(len(t) == PARITY.max_tokens for t in tokens[0])
