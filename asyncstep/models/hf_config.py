"""An HF ``config.json`` read into a :class:`~asyncstep.models.config.ModelArchConfig`.

:func:`parse_hf_config` reads a config (transformers 4.x or 5.x spelling),
every field type-checked and bounded before any arithmetic on it, and
returns the arch config after :meth:`ModelArchConfig.validate
<asyncstep.models.config.ModelArchConfig.validate>`; where a field is
absent, each architecture's default is transformers'.

Sliding windows: Mistral's ``sliding_window`` applies to every layer (its
``layer_types`` is ignored, as transformers ignores it); Qwen2/Qwen3 use a
window only with ``use_sliding_window``, on the layers ``layer_types`` names
``sliding_attention`` or, without ``layer_types``, on layers
``>= max_window_layers``; Mixtral's applies to every layer, Qwen3-MoE's
to every layer with ``use_sliding_window``; Gemma 3's (4096 when absent) to
the layers ``layer_types`` names sliding or, without ``layer_types``, every
layer but each ``sliding_window_pattern``-th (6 when absent); gpt-oss's
``sliding_window`` (default 128) on the layers ``layer_types`` names sliding
(default: the even layers, :data:`LAYER_TYPES_WINDOW`); Llama (any other
architecture) has none (:data:`EVERY_LAYER_WINDOW`, :data:`QWEN_STYLE_WINDOW`,
:data:`EVERY_LAYER_WINDOW_WHEN_USED`).

May import only the standard library, ``asyncstep.errors``,
:mod:`asyncstep.models.limits` and :mod:`asyncstep.models.config` (the arch
config, its tables and its validators).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.config import (
    ARCHITECTURES,
    FULL_ATTENTION,
    GEMMA_FAMILIES,
    MOE_FAMILIES,
    SIZE_BOUNDS,
    SLIDING_ATTENTION,
    ModelArchConfig,
    validate_layer_types,
    validate_rope_scaling,
)
from asyncstep.models.limits import (
    MAX_CONTEXT_LENGTH,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_EXPERTS,
    MAX_NUM_LAYERS,
    bounded_float,
    bounded_int,
)

#: gpt-oss's swigluoai constants, the only ones the experts' ops compute.
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
#: Architectures whose ``sliding_window`` applies to every layer (transformers'
#: Mistral attention; its ``layer_types`` is ignored).
EVERY_LAYER_WINDOW = frozenset({"MistralForCausalLM", "MixtralForCausalLM"})
#: Architectures whose window, with ``use_sliding_window``, is on every layer
#: (Qwen3MoeConfig.__post_init__; no ``layer_types``).
EVERY_LAYER_WINDOW_WHEN_USED = frozenset({"Qwen3MoeForCausalLM"})
#: Architectures whose window is on the layers ``layer_types`` names
#: (GptOssConfig.__post_init__: without ``layer_types``, the even layers).
LAYER_TYPES_WINDOW = frozenset({"GptOssForCausalLM"})
#: Architectures with Qwen2's rule: a window only with ``use_sliding_window``,
#: on the layers ``layer_types`` (or ``max_window_layers``) names.
QWEN_STYLE_WINDOW = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM"})
#: transformers' older ``layer_types`` names -> today's (``remap_legacy_layer_types``).
_LEGACY_LAYER_TYPES = {"attention": FULL_ATTENTION}
_HF_REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_HF_GUESSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
_MISSING: Any = object()


def parse_hf_config(cfg: Mapping[str, Any]) -> ModelArchConfig:
    """The arch config of an HF ``config.json`` dict (transformers 4.x or 5.x
    spelling), every field type-checked and bounded before any arithmetic on it."""
    if not isinstance(cfg, Mapping):
        raise ModelLoadError(f"config: expected an object, got {type(cfg).__name__}")
    arch = _hf_architecture(cfg)
    family = ARCHITECTURES[arch]
    sizes: dict[str, Any] = {name: _hf_size(cfg, name) for name in _HF_REQUIRED_SIZES}
    hidden, n_heads = sizes["hidden_size"], sizes["num_attention_heads"]
    n_kv = _hf_size(cfg, "num_key_value_heads", n_heads)
    head_dim = _hf_size(cfg, "head_dim", max(hidden // n_heads, 1))
    gemma = _hf_gemma(cfg, sizes["num_hidden_layers"]) if family in GEMMA_FAMILIES else {}
    rope = _hf_rope(cfg) if not gemma else gemma.pop("rope_parameters")
    theta = rope.pop("rope_theta", None)
    theta = _hf_value(cfg, "rope_theta", 10000.0) if theta is None else theta
    validate_rope_scaling(rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    window, layer_types = _hf_windows(cfg, arch, sizes["num_hidden_layers"])
    fields: dict[str, Any] = dict(
        architecture=arch,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=bounded_float(
            "config: rms_norm_eps", _hf_value(cfg, "rms_norm_eps", 1e-6), 1.0
        ),
        rope_theta=bounded_float("config: rope_theta", theta, math.inf),
        rope_scaling=rope if rope and rope_type != "default" else None,
        max_position_embeddings=_hf_size(cfg, "max_position_embeddings", 4096),
        tie_word_embeddings=_hf_value(cfg, "tie_word_embeddings", False),
        attention_bias=_hf_value(cfg, "attention_bias", family in ("qwen2", "gpt_oss")),
        qk_norm=family in ("qwen3", "qwen3_moe", "olmoe"),
        attention_sinks=family == "gpt_oss",
        qk_norm_per_head=family != "olmoe",
        hidden_act=_hf_value(cfg, "hidden_act", "silu"),
        bos_token_id=_hf_value(cfg, "bos_token_id", None),
        eos_token_ids=_hf_eos(cfg.get("eos_token_id")),
        sliding_window=window,
        layer_types=layer_types,
        **sizes,
        **_hf_moe(cfg, family, sizes["intermediate_size"]),
    )
    config = ModelArchConfig(**(fields | gemma))
    config.validate()
    return config


def _hf_windows(
    cfg: Mapping[str, Any], arch: str, num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """``sliding_window`` and ``layer_types`` as transformers 5 reads them for
    ``arch``: :data:`EVERY_LAYER_WINDOW` architectures on every layer,
    :data:`EVERY_LAYER_WINDOW_WHEN_USED` ones too with ``use_sliding_window``,
    :data:`QWEN_STYLE_WINDOW` ones per layer with ``use_sliding_window``,
    any other none."""
    used_only = QWEN_STYLE_WINDOW | EVERY_LAYER_WINDOW_WHEN_USED
    if arch in LAYER_TYPES_WINDOW:
        return _gpt_oss_windows(cfg, num_layers)
    if arch not in EVERY_LAYER_WINDOW and arch not in used_only:
        return None, ()
    window = cfg.get("sliding_window")
    if arch in used_only and cfg.get("use_sliding_window") is not True:
        window = None  # Qwen2Config.__post_init__: no window without use_sliding_window
    if window is None:
        return None, ()
    window = bounded_int("config: sliding_window", window, MAX_CONTEXT_LENGTH)
    if arch not in QWEN_STYLE_WINDOW:
        return window, ()  # every layer (Mistral ignores layer_types)
    types = cfg.get("layer_types")
    if types is None:
        first = bounded_int(
            "config: max_window_layers", _hf_value(cfg, "max_window_layers", 28), 2**31, low=0
        )
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    return window, _hf_layer_types(types, num_layers)


def _hf_layer_types(types: Any, num_layers: int) -> tuple[str, ...]:
    if not isinstance(types, list) or len(types) > MAX_NUM_LAYERS:
        raise ModelLoadError("config: layer_types must be a list of names")
    layer_types = tuple(_LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in types)
    validate_layer_types(layer_types, num_layers)
    return layer_types


def _gpt_oss_windows(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """gpt-oss: ``sliding_window`` (default 128) on the layers ``layer_types``
    names sliding (default: the even layers, GptOssConfig's)."""
    window = bounded_int(
        "config: sliding_window", _hf_value(cfg, "sliding_window", 128), MAX_CONTEXT_LENGTH
    )
    types = cfg.get("layer_types")
    if types is None:
        types = [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
    return window, _hf_layer_types(types, num_layers)


def _hf_gemma(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """A Gemma 3 text config's fields as transformers 5 reads them
    (``Gemma3TextConfig``; its defaults where a field is absent): the full
    layers' rope (``rope_parameters["full_attention"]``, or 4.x's
    ``rope_theta`` / ``rope_scaling``) under ``"rope_parameters"`` for the
    caller, the sliding layers' base (``rope_parameters["sliding_attention"]``
    or ``rope_local_base_freq``: default rope only), ``layer_types`` (or every
    ``sliding_window_pattern``-th layer full), tied embeddings by default."""
    for option in ("use_bidirectional_attention", "attention_bias"):
        if cfg.get(option) not in (None, False):
            raise UnsupportedModelError(f"unsupported Gemma 3 option {option} (only false)")
    full, local = _hf_gemma_rope(cfg)
    window = cfg.get("sliding_window", 4096)
    if window is not None:
        window = bounded_int("config: sliding_window", window, MAX_CONTEXT_LENGTH)
    types = cfg.get("layer_types")
    if types is None:
        pattern = bounded_int(
            "config: sliding_window_pattern",
            _hf_value(cfg, "sliding_window_pattern", 6),
            MAX_NUM_LAYERS,
        )
        types = [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) > MAX_NUM_LAYERS:
        raise ModelLoadError("config: layer_types must be a list of names")
    layer_types = tuple(types)
    validate_layer_types(layer_types, num_layers)
    return {
        "rope_parameters": full,
        "rope_local_base_freq": local,
        "query_pre_attn_scalar": _hf_value(cfg, "query_pre_attn_scalar", 256),
        "hidden_act": _hf_value(cfg, "hidden_activation", "gelu_pytorch_tanh"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "sliding_window": window,
        "layer_types": layer_types,
        "tie_word_embeddings": _hf_value(cfg, "tie_word_embeddings", True),
        "max_position_embeddings": _hf_size(cfg, "max_position_embeddings", 131072),
        "attention_bias": False,
        "qk_norm": True,
        "qk_norm_per_head": True,
    }


def _hf_gemma_rope(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """Gemma 3's full layers' rope (a copy, ``rope_theta`` in it) and its
    sliding layers' base, from transformers 5's per-layer-type
    ``rope_parameters`` or 4.x's fields (global base 1e6, local 1e4 by default)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (FULL_ATTENTION in params or SLIDING_ATTENTION in params):
        full, local = (params.get(kind) for kind in (FULL_ATTENTION, SLIDING_ATTENTION))
        full, local = ({} if p is None else p for p in (full, local))
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ModelLoadError("config: rope_parameters must map layer types to objects")
        full = {"rope_theta": 1_000_000.0} | full
        local_type = local.get("rope_type", local.get("type", "default"))
        if local_type != "default":
            shown = repr(local_type)[:40]
            raise UnsupportedModelError(f"unsupported sliding-layer rope {shown} (default)")
        return full, local.get("rope_theta", 10_000.0)
    full = _hf_rope(cfg)
    full.setdefault("rope_theta", _hf_value(cfg, "rope_theta", 1_000_000.0))
    return full, _hf_value(cfg, "rope_local_base_freq", 10_000.0)


def _hf_value(cfg: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    """``cfg[key]``; ``default`` when it is absent or null (no default: an error)."""
    value = cfg.get(key)
    if value is not None:
        return value
    if default is _MISSING:
        raise ModelLoadError(f"config: missing or invalid field: {key!r} is missing")
    return default


def _hf_size(cfg: Mapping[str, Any], key: str, default: Any = _MISSING) -> int:
    return bounded_int(f"config: {key}", _hf_value(cfg, key, default), SIZE_BOUNDS[key])


def _hf_architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError("config: architectures must be a list of names")
    if not archs:
        model_type = cfg.get("model_type")
        guess = _HF_GUESSES.get(model_type) if isinstance(model_type, str) else None
        if guess is None:
            raise UnsupportedModelError(f"config names no architecture (model_type {model_type!r})")
        archs = [guess]
    if archs[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {archs[0]!r}; asyncstep runs "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return archs[0]


def _hf_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"config: rope_scaling must be an object, got {type(rope).__name__}")
    return dict(rope)


def _hf_moe(cfg: Mapping[str, Any], family: str, intermediate_size: int) -> dict[str, Any]:
    """The expert fields of a MoE family's HF config (none for a dense family),
    each bounded before use. Qwen3-MoE names its expert count ``num_experts``
    (transformers 5 writes ``num_local_experts``), OLMoE ``num_experts``,
    Mixtral ``num_local_experts``; Mixtral and OLMoE experts are
    ``intermediate_size`` wide, Qwen3-MoE's ``moe_intermediate_size``."""
    if family not in MOE_FAMILIES:
        return {}
    if family == "gpt_oss":
        return _hf_gpt_oss_moe(cfg, intermediate_size)
    if family == "olmoe" and cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError("unsupported OLMoE option clip_qkv (only null)")
    key = "num_local_experts" if family == "mixtral" or "num_experts" not in cfg else "num_experts"
    num_experts = bounded_int(f"config: {key}", _hf_value(cfg, key), MAX_NUM_EXPERTS)
    top_k = _hf_value(cfg, "num_experts_per_tok")
    bounded_int("config: num_experts_per_tok", top_k, num_experts)
    moe = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": intermediate_size,
        "norm_topk_prob": True if family == "mixtral" else _hf_value(cfg, "norm_topk_prob", False),
    }
    if family == "qwen3_moe":
        only = _hf_value(cfg, "mlp_only_layers", [])
        if not isinstance(only, list) or len(only) > MAX_NUM_LAYERS:
            raise ModelLoadError("config: mlp_only_layers must be a list of layer indices")
        moe |= {
            "moe_intermediate_size": bounded_int(
                "config: moe_intermediate_size",
                _hf_value(cfg, "moe_intermediate_size"),
                MAX_INTERMEDIATE_SIZE,
            ),
            "decoder_sparse_step": _hf_value(cfg, "decoder_sparse_step", 1),
            "mlp_only_layers": tuple(only),
        }
    return moe


def _hf_gpt_oss_moe(cfg: Mapping[str, Any], intermediate_size: int) -> dict[str, Any]:
    """gpt-oss's experts: ``num_local_experts`` of ``intermediate_size``, the
    router's top-k logits softmaxed (never renormalised), swigluoai with transformers' constants
    (the ops compute no others); MXFP4 experts (``quantization_config``'s
    ``quant_method`` "mxfp4", sizes multiples of 32) dequantized at load,
    any other quantization refused."""
    quant = cfg.get("quantization_config")
    mxfp4 = False
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method != "mxfp4":
            raise UnsupportedModelError(
                f"unsupported quantization {repr(method)[:40]} of gpt-oss's experts (mxfp4, "
                "or none)"
            )
        mxfp4 = True
        for key in ("hidden_size", "intermediate_size"):
            if _hf_size(cfg, key) % 32:
                raise ModelLoadError(f"config: MXFP4 experts need {key} a multiple of 32")
    num_experts = bounded_int(
        "config: num_local_experts", _hf_value(cfg, "num_local_experts"), MAX_NUM_EXPERTS
    )
    top_k = bounded_int(
        "config: num_experts_per_tok", _hf_value(cfg, "num_experts_per_tok"), num_experts
    )
    for key, value in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        given = _hf_value(cfg, key, value)
        if given != value or isinstance(given, bool):
            raise UnsupportedModelError(
                f"unsupported gpt-oss {key} {repr(given)[:40]} (only {value})"
            )
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": intermediate_size,
        "scoring_func": "topk_softmax",
        "norm_topk_prob": False,  # (the top-k logits' softmax sums to one)
        "moe_activation": "swigluoai",
        "experts_mxfp4": mxfp4,
    }


def _hf_eos(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, list):
        return tuple(eos)
    return (eos,)
