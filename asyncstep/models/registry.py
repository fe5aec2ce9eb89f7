"""Which model class runs which family (:data:`~asyncstep.models.families.ARCHITECTURES`).

May import the model files.
"""

from __future__ import annotations

from asyncstep.models.config import ModelArchConfig
from asyncstep.models.gemma3 import Gemma3ForCausalLM
from asyncstep.models.gpt_oss import GptOssForCausalLM
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.models.moe import MixtralForCausalLM, OlmoeForCausalLM, Qwen3MoeForCausalLM

__all__ = ["MODEL_CLASSES", "model_class"]

#: Model family -> its causal LM class.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def model_class(arch: ModelArchConfig) -> type[LlamaForCausalLM]:
    """The class that builds ``arch``'s model (``arch`` validated)."""
    return MODEL_CLASSES[arch.family]
