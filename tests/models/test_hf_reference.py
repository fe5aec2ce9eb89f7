"""transformers' reference config (``asyncstep.models.hf_reference.hf_config``)
read back from our reading of a family's config: the same model as the
parity tests' tiny configs describe, field for field (the benchmarks' HF
runs build transformers' model from it)."""

from __future__ import annotations

from typing import Any

import pytest

from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.hf_reference import hf_config
from tests.models import test_gemma3, test_gpt_oss, test_moe

#: Fields that do not shape the model (or that transformers derives alike).
IGNORED = {"transformers_version", "architectures", "_name_or_path", "initializer_range"}
IGNORED |= {"pad_token_id", "use_sliding_window"}


def tiny(family: str) -> Any:
    if family == "gemma3":
        return test_gemma3.tiny_config()
    if family == "gpt_oss":
        return test_gpt_oss.tiny_config()
    return test_moe.tiny_config(family)


ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_the_reference_config_is_the_family_s_own(family: str) -> None:
    theirs = tiny(family).to_dict()
    arch = parse_hf_config(theirs | {"architectures": [ARCHITECTURES[family]]})
    ours = hf_config(arch).to_dict()
    assert type(hf_config(arch)).__name__ == type(tiny(family)).__name__
    differ = {
        key: (theirs.get(key), ours.get(key))
        for key in set(theirs) | set(ours)
        if key not in IGNORED and theirs.get(key) != ours.get(key)
    }
    if differ.get("head_dim", (0, 0))[0] is None:  # theirs derives hidden / heads
        assert differ.pop("head_dim")[1] == arch.hidden_size // arch.num_attention_heads
    assert not differ
