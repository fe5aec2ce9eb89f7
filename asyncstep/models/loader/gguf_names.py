"""llama.cpp's names, per GGUF architecture: which HF architecture a
``general.architecture`` is (:data:`GGUF_ARCHITECTURES`), and which HF
parameter each GGUF tensor is (:func:`hf_tensor_name`: the Llama family's
block names, :data:`~asyncstep.models.loader.gguf_layouts.ARCH_BLOCK_NAMES`
where an architecture's differ, the stacks of experts until the config says
how many experts they hold). :class:`~asyncstep.models.loader.gguf.GGUFCheckpoint`
reads a file through them.

Imports :mod:`asyncstep.errors` and :mod:`asyncstep.models.loader.gguf_layouts` only.
"""

from __future__ import annotations

import re

from asyncstep.errors import UnsupportedModelError
from asyncstep.models.loader.gguf_layouts import ARCH_BLOCK_NAMES, EXPERT_STACKS, GPT_OSS_STACKS

__all__ = [
    "EXPERT_STACK_NAME",
    "GGUF_ARCHITECTURES",
    "GGUF_LLAMA_MOE",
    "hf_tensor_name",
]

#: GGUF ``general.architecture`` -> HF ``architectures`` name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
#: A ``llama`` GGUF with experts (llama.cpp converts Mixtral so).
GGUF_LLAMA_MOE = "MixtralForCausalLM"

#: Tensors outside the blocks: GGUF base name -> HF module name.
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

#: Tensors inside block N: GGUF base name -> HF module name under ``model.layers.N``.
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
#: How :func:`hf_tensor_name` names a stack until the config says how many experts.
EXPERT_STACK_NAME = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(ffn_\w+_exps)\.weight")

#: GGUF tensors HF models do not have. ``rope_freqs`` holds llama3 rope factors;
#: rope scaling is taken from the metadata instead.
_IGNORED_GLOBAL = frozenset({"rope_freqs"})
_IGNORED_BLOCK = frozenset({"attn_rot_embd"})

_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<kind>weight|bias)")


def hf_tensor_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """The HF parameter name of a GGUF tensor of architecture ``gguf_arch``;
    None for tensors HF has no use for. A stack of experts is named
    ``model.layers.N.mlp.experts.<its GGUF base name>.weight`` until the
    config says how many experts it holds (gpt-oss's stacks: also ``.bias``).

    Raises :class:`UnsupportedModelError` for a tensor no supported model has.
    """
    match = _TENSOR_NAME.fullmatch(gguf_name)
    if match is not None:
        base, kind, layer = match["base"], match["kind"], match["layer"]
        if layer is None:
            if base in _IGNORED_GLOBAL:
                return None
            if base in _GLOBAL_NAMES:
                return f"{_GLOBAL_NAMES[base]}.{kind}"
        else:
            if base in _IGNORED_BLOCK:
                return None
            module = ARCH_BLOCK_NAMES.get(gguf_arch, {}).get(base, _BLOCK_NAMES.get(base))
            if module == "self_attn.sinks" and kind == "weight":
                return f"model.layers.{int(layer)}.{module}"  # a parameter, not a module
            if module is not None:
                return f"model.layers.{int(layer)}.{module}.{kind}"
            if gguf_arch == "gpt-oss" and base in GPT_OSS_STACKS:
                return f"model.layers.{int(layer)}.mlp.experts.{base}.{kind}"
            if base in EXPERT_STACKS and kind == "weight":
                return f"model.layers.{int(layer)}.mlp.experts.{base}.weight"
    raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")
