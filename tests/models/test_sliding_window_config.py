"""The per-layer sliding window read from HF configs and GGUF metadata:
transformers' own config classes give the expected windows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncstep.errors import ModelLoadError
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.hf_reference import hf_config
from asyncstep.models.loader.gguf import GGUFCheckpoint
from tests.models.test_loaders import gguf_name, random_block_tensors, write_gguf

TINY: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _hf_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's window as transformers' attention layer takes it."""
    types = getattr(config, "layer_types", None)
    if config.model_type == "mistral":
        return (config.sliding_window,) * config.num_hidden_layers
    assert types is not None
    return tuple(config.sliding_window if t == "sliding_attention" else None for t in types)


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        ("MistralConfig", {"sliding_window": 8}),
        ("MistralConfig", {"sliding_window": None}),
        ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("Qwen2Config", {"use_sliding_window": False, "sliding_window": 8}),
        (
            "Qwen3Config",
            {
                "use_sliding_window": True,
                "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
        ),
        (
            "Qwen3Config",
            {"sliding_window": 5, "layer_types": ["sliding_attention"] * 4},
        ),
    ],
)
def test_windows_match_transformers(cls: str, extra: dict[str, Any]) -> None:
    import transformers

    config = getattr(transformers, cls)(**TINY, **extra)
    ours = parse_hf_config(config.to_dict())
    assert ours.layer_windows == _hf_windows(config)
    # The parity tests' reference model (hf_reference) has the same windows.
    assert _hf_windows(hf_config(ours)) == ours.layer_windows


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        ("MixtralConfig", {"sliding_window": 8}),
        ("MixtralConfig", {"sliding_window": None}),
        ("Qwen3MoeConfig", {"use_sliding_window": True, "sliding_window": 6}),
        ("Qwen3MoeConfig", {"use_sliding_window": False, "sliding_window": 6}),
    ],
)
def test_moe_windows_match_transformers(cls: str, extra: dict[str, Any]) -> None:
    """Mixtral's and Qwen3-MoE's attention take ``config.sliding_window`` on
    every layer (Qwen3MoeConfig clears it without ``use_sliding_window``)."""
    import transformers

    config = getattr(transformers, cls)(**TINY, **extra)
    ours = parse_hf_config(config.to_dict())
    assert ours.layer_windows == (config.sliding_window,) * config.num_hidden_layers


def test_llama_has_no_window_and_gguf_style_config_slides_every_layer() -> None:
    llama = {**TINY, "architectures": ["LlamaForCausalLM"], "sliding_window": 8}
    assert parse_hf_config(llama).layer_windows == (None,) * 4
    gguf_like = parse_hf_config(llama).replace(sliding_window=16)
    gguf_like.validate()
    assert gguf_like.layer_windows == (16,) * 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"sliding_window": 0}, "sliding_window must be in"),
        ({"sliding_window": 2.5}, "sliding_window must be an integer"),
        ({"sliding_window": True}, "sliding_window must be an integer"),
        ({"sliding_window": "4096"}, "sliding_window must be an integer"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types names 3 layers"),
        ({"layer_types": ["chunked_attention"] * 4}, "unsupported layer type"),
        ({"layer_types": [1, 2, 3, 4]}, "unsupported layer type int"),
        ({"layer_types": "sliding_attention"}, "layer_types must be a list"),
        ({"max_window_layers": -1}, "max_window_layers must be in"),
    ],
)
def test_hostile_window_fields_are_one_line_errors(extra: dict[str, Any], message: str) -> None:
    cfg = {
        **TINY,
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": True,
        "sliding_window": 8,
        **extra,
    }
    with pytest.raises(ModelLoadError, match=message) as info:
        parse_hf_config(cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("window", "expected"), [(8, (8, 8)), (None, (None, None))])
def test_gguf_sliding_window_slides_every_layer(
    tmp_path: Path, window: int | None, expected: tuple[int | None, ...]
) -> None:
    rng = np.random.default_rng(0)
    hf = random_block_tensors(rng, layers=2, hidden=32, ffn=64, q=32, kv=16, vocab=8)
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {gguf_name(k): v for k, v in hf.items()},
        vocab_size=8,
        tokenizer=False,
        sliding_window=window,
    )
    assert GGUFCheckpoint(path).arch_config().layer_windows == expected


def test_gguf_hostile_sliding_window(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        {"token_embd.weight": np.zeros((8, 32), np.float32)},
        vocab_size=8,
        tokenizer=False,
        sliding_window="4096",
    )
    with pytest.raises(ModelLoadError, match="sliding_window must be an integer") as info:
        GGUFCheckpoint(path)
    assert "\n" not in str(info.value)
