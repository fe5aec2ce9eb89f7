"""The KV cache bytes one 8k-token request holds in a Gemma-3-shaped model
(34 layers, 5 sliding-window layers of window 1024 to each full-attention
layer, as Gemma 3 4B) against the same model with full attention on every
layer. Each model is a tiny random Qwen3 checkpoint with that layer pattern
(``layer_types``; its heads are small, so the run is quick): the engine runs
one request of an 8192-token prompt, and the blocks it holds are read from
the engine's statistics once it has decoded a few tokens. The bytes are
those blocks in Gemma 3 4B's KV shape (4 KV heads of 256, bfloat16) and in
the tiny model's own.

    python3 benchmarks/studies/sliding_window/kv_bytes.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.kv_cache_interface import kv_cache_groups
from asyncstep.models.config import ModelArchConfig

NUM_LAYERS = 34
WINDOW = 1024
PROMPT_TOKENS = 8192
DECODE_TOKENS = 16
BLOCK_SIZE = 16
#: Gemma 3 4B's KV shape: bytes of one layer's keys and values per token (bf16).
GEMMA3_4B_LAYER_TOKEN_BYTES = 2 * 4 * 256 * 2


def layer_types(hybrid: bool) -> list[str]:
    return [
        "full_attention" if not hybrid or i % 6 == 5 else "sliding_attention"
        for i in range(NUM_LAYERS)
    ]


def write_checkpoint(path: Path, hybrid: bool) -> None:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=PROMPT_TOKENS + 256,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=layer_types(hybrid),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


async def held_blocks(path: Path) -> dict[str, Any]:
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
    arch = ModelArchConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    groups = kv_cache_groups(arch.layer_windows)
    used = round(stats.kv_cache_usage * stats.num_kv_blocks)
    held = used - (1 if any(g.sliding_window for g in groups) else 0)  # the null block
    layers_per_block = len(groups[0].layer_ids)
    return {
        "kv_cache_groups": len(groups),
        "layers_per_block": layers_per_block,
        "held_blocks": held,
        "held_layer_blocks": held * layers_per_block,
        "gemma3_4b_bytes": held * layers_per_block * BLOCK_SIZE * GEMMA3_4B_LAYER_TOKEN_BYTES,
        "tiny_model_fp32_bytes": held * layers_per_block * BLOCK_SIZE * 2 * 1 * 16 * 4,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, hybrid in (("full_attention", False), ("gemma3_pattern", True)):
            path = Path(tmp) / name
            write_checkpoint(path, hybrid)
            results[name] = await held_blocks(path)
    ratio = (
        results["gemma3_pattern"]["gemma3_4b_bytes"] / results["full_attention"]["gemma3_4b_bytes"]
    )
    results["ratio"] = round(ratio, 4)
    results["setup"] = {
        "layers": NUM_LAYERS,
        "pattern": "5 sliding : 1 full",
        "window": WINDOW,
        "prompt_tokens": PROMPT_TOKENS,
        "decoded_tokens_at_reading": DECODE_TOKENS,
        "block_size": BLOCK_SIZE,
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_bytes.json").write_text(text + "\n")


if __name__ == "__main__":
    trio.run(main)
