"""YaRN rope (gpt-oss's) against transformers' own: the cos/sin cache equals
``GptOssRotaryEmbedding``'s cos and sin (its attention factor included) bit
for bit, truncated or not, with the factor inferred or from ``mscale``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncstep.models.layers.rotary import RotaryEmbedding

YARNS: list[dict[str, Any]] = [
    {  # gpt-oss's
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 0.9,
    },
]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("rope", YARNS)
def test_yarn_cache_is_transformers(rope: dict[str, Any]) -> None:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = transformers.GptOssConfig(
        head_dim=16,
        num_attention_heads=4,
        hidden_size=64,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 10000.0} | rope,
    )
    hf = GptOssRotaryEmbedding(config)
    cos, sin = hf(torch.zeros(1), torch.arange(256)[None])
    scaling = dict(config.rope_parameters)
    theta = scaling.pop("rope_theta")
    cache = RotaryEmbedding(16, 256, theta, scaling).cos_sin_cache
    assert hf.attention_scaling != 1.0
    assert torch.equal(cache[:, :8], cos[0]) and torch.equal(cache[:, 8:], sin[0])
