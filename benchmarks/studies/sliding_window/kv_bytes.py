"""The KV cache bytes one 8k-token request holds in a Gemma-3-shaped model
(34 layers, 5 sliding-window layers of window 1024 to each full-attention
layer, as Gemma 3 4B) against the same model with full attention on every
layer. Each model is a tiny random Qwen3 checkpoint with that layer pattern
(``layer_types``; its heads are small, so the run is quick): the engine runs
one request of an 8192-token prompt, and the blocks it holds are read from
the engine's statistics once it has decoded a few tokens. The bytes are
those blocks in Gemma 3 4B's KV shape (4 KV heads of 256, bfloat16) and in
the tiny model's own.

With ``--model gemma3-1b`` each model is a tiny random Gemma 3 text
checkpoint (``Gemma3TextConfig``, run by asyncstep's Gemma 3 model) with
gemma-3-1b's layers: 26, window 512, ``layer_types`` as transformers derives
them from ``sliding_window_pattern`` 6 (layers 5, 11, 17, 23 full); bytes in
gemma-3-1b's KV shape (1 KV head of 256, bfloat16).

    python3 benchmarks/studies/sliding_window/kv_bytes.py [--model gemma3-1b] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.kv_cache_interface import kv_cache_groups
from asyncstep.models.hf_config import parse_hf_config

PROMPT_TOKENS = 8192
DECODE_TOKENS = 16
BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Shape:
    """A studied model: its layers, window, the real model whose KV shape
    prices the blocks (bytes of one layer's keys and values per token, bf16)
    and the checkpoint family run (``qwen3``: the pattern as ``layer_types``;
    ``gemma3``: a Gemma 3 text config)."""

    name: str
    #: The results' key of those bytes.
    bytes_key: str
    num_layers: int
    window: int
    layer_token_bytes: int
    family: str


SHAPES = {
    "gemma3-4b": Shape("Gemma 3 4B", "gemma3_4b_bytes", 34, 1024, 2 * 4 * 256 * 2, "qwen3"),
    "gemma3-1b": Shape("gemma-3-1b", "gemma3_1b_bytes", 26, 512, 2 * 1 * 256 * 2, "gemma3"),
}


def layer_types(shape: Shape, hybrid: bool) -> list[str]:
    return [
        "full_attention" if not hybrid or i % 6 == 5 else "sliding_attention"
        for i in range(shape.num_layers)
    ]


def write_checkpoint(path: Path, shape: Shape, hybrid: bool) -> None:
    import transformers

    torch.manual_seed(0)
    if shape.family == "gemma3":
        gemma = transformers.Gemma3TextConfig(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=PROMPT_TOKENS + 256,
            sliding_window=shape.window,
            # None: transformers' own 5:1 pattern (sliding_window_pattern 6).
            layer_types=None if hybrid else layer_types(shape, False),
        )
        transformers.Gemma3ForCausalLM(gemma).save_pretrained(path)
        return
    config = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=PROMPT_TOKENS + 256,
        use_sliding_window=True,
        sliding_window=shape.window,
        layer_types=layer_types(shape, hybrid),
        tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


async def held_blocks(path: Path, shape: Shape) -> dict[str, Any]:
    """Blocks the request holds after its prompt and DECODE_TOKENS tokens."""
    prompt = torch.randint(1, 500, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS + 8, ignore_eos=True)
    async with asyncstep.open_engine(
        path,
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=PROMPT_TOKENS + 64,
        enable_prefix_caching=False,
    ) as engine:
        seen, stats = 0, None
        async for chunk in engine.stream(prompt.tolist(), params):
            seen += len(chunk.token_ids)
            if seen >= DECODE_TOKENS and stats is None:
                stats = engine.statistics()
        assert stats is not None
    arch = parse_hf_config(json.loads((path / "config.json").read_text()))
    groups = kv_cache_groups(arch.layer_windows)
    used = round(stats.kv_cache_usage * stats.num_kv_blocks)
    held = used - (1 if any(g.sliding_window for g in groups) else 0)  # the null block
    layers_per_block = len(groups[0].layer_ids)
    return {
        "kv_cache_groups": len(groups),
        "layers_per_block": layers_per_block,
        "held_blocks": held,
        "held_layer_blocks": held * layers_per_block,
        shape.bytes_key: held * layers_per_block * BLOCK_SIZE * shape.layer_token_bytes,
        "tiny_model_fp32_bytes": held * layers_per_block * BLOCK_SIZE * 2 * 1 * 16 * 4,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="gemma3-4b")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = SHAPES[args.model]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, hybrid in (("full_attention", False), ("gemma3_pattern", True)):
            path = Path(tmp) / name
            write_checkpoint(path, shape, hybrid)
            results[name] = await held_blocks(path, shape)
    ratio = results["gemma3_pattern"][shape.bytes_key] / results["full_attention"][shape.bytes_key]
    results["ratio"] = round(ratio, 4)
    results["setup"] = {
        "bytes_priced_as": shape.name,
        "checkpoint": shape.family,
        "layers": shape.num_layers,
        "pattern": "5 sliding : 1 full",
        "window": shape.window,
        "prompt_tokens": PROMPT_TOKENS,
        "decoded_tokens_at_reading": DECODE_TOKENS,
        "block_size": BLOCK_SIZE,
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "" if args.model == "gemma3-4b" else f"_{args.model.replace('-', '_')}"
        (args.out / f"kv_bytes{suffix}.json").write_text(text + "\n")


if __name__ == "__main__":
    trio.run(main)
