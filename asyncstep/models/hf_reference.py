"""transformers' own model on our weights: the reference that parity tests
and benchmarks compare asyncstep against (same weights, HF's code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncstep.errors import UnsupportedModelError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.loader import open_checkpoint

_CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "OlmoeForCausalLM": "OlmoeConfig",
    "GptOssForCausalLM": "GptOssConfig",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
}


def hf_config(arch: ModelArchConfig, **overrides: Any) -> Any:
    """A transformers config of ``arch``'s shape, for every family we run."""
    import transformers

    if arch.architecture not in _CONFIG_CLASSES:
        raise UnsupportedModelError(f"no transformers reference config for {arch.architecture}")
    cls = getattr(transformers, _CONFIG_CLASSES[arch.architecture])
    rope: dict[str, Any] = {"rope_theta": arch.rope_theta}
    if arch.rope_scaling:
        rope["rope_scaling"] = dict(arch.rope_scaling)
    fields: dict[str, Any] = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=arch.bos_token_id,
        eos_token_id=list(arch.eos_token_ids) or None,
        **rope,
    )
    if arch.architecture in ("LlamaForCausalLM", "GptOssForCausalLM"):
        fields["attention_bias"] = arch.attention_bias
    return cls(**(fields | _hf_windows(arch) | _hf_experts(arch) | _hf_gemma3(arch) | overrides))


def _hf_experts(arch: ModelArchConfig) -> dict[str, Any]:
    """A MoE family's expert fields, by the names its transformers config reads."""
    if not arch.is_moe:
        return {}
    fields: dict[str, Any] = {"num_experts_per_tok": arch.num_experts_per_tok}
    name = arch.architecture
    if name in ("MixtralForCausalLM", "GptOssForCausalLM"):
        fields["num_local_experts"] = arch.num_experts
    else:
        fields["num_experts"] = arch.num_experts
    if name in ("OlmoeForCausalLM", "GptOssForCausalLM"):
        fields["intermediate_size"] = arch.moe_intermediate_size
    if name == "Qwen3MoeForCausalLM":
        fields |= {
            "moe_intermediate_size": arch.moe_intermediate_size,
            "decoder_sparse_step": arch.decoder_sparse_step,
            "mlp_only_layers": list(arch.mlp_only_layers),
        }
    if name in ("Qwen3MoeForCausalLM", "OlmoeForCausalLM"):
        fields["norm_topk_prob"] = arch.norm_topk_prob
    return fields


def _hf_gemma3(arch: ModelArchConfig) -> dict[str, Any]:
    """Gemma 3's own fields: its attention scale, local rotary base and softcaps."""
    if arch.architecture != "Gemma3ForCausalLM":
        return {}
    return {
        "query_pre_attn_scalar": arch.query_pre_attn_scalar,
        "rope_local_base_freq": arch.rope_local_base_freq,
        "final_logit_softcapping": arch.final_logit_softcapping,
        "attn_logit_softcapping": arch.attn_logit_softcapping,
        "hidden_activation": arch.hidden_act,
    }


def _hf_windows(arch: ModelArchConfig) -> dict[str, Any]:
    """The config fields that give transformers ``arch``'s sliding windows
    (a Llama has none: a GGUF's window is not in its reference)."""
    if arch.architecture == "MistralForCausalLM":
        return {"sliding_window": arch.sliding_window}
    if arch.family == "llama" or arch.sliding_window is None:
        return {}
    n = arch.num_hidden_layers
    types = list(arch.layer_types) or ["sliding_attention"] * n
    return {"use_sliding_window": True, "sliding_window": arch.sliding_window, "layer_types": types}


def hf_reference_model(model: str | Path | None = None, **config_overrides: Any) -> Any:
    """transformers' causal LM on the checkpoint's weights (fp32, CPU, eval)."""
    import transformers

    checkpoint = open_checkpoint(model)
    config = hf_config(checkpoint.arch_config(), **config_overrides)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = hf.load_state_dict(dict(checkpoint.iter_weights()), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"reference model: missing {missing}, unexpected {unexpected}")
    return hf
