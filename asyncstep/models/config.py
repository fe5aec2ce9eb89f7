"""The architecture of a decoder-only model, read from an HF config or GGUF metadata."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncstep.errors import ModelLoadError, UnsupportedModelError

#: HF ``architectures`` names -> our model family.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and options of a Llama-family model (Llama, Mistral, Qwen2, Qwen3)."""

    architecture: str  # an HF architectures name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: HF ``rope_scaling`` / ``rope_parameters`` beyond the theta (llama3, linear, ...).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    #: Bias on q/k/v projections (Qwen2).
    attention_bias: bool = False
    #: RMSNorm on q and k per head before rotary (Qwen3).
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelArchConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raise a one-line error for a config no model can be built from."""
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; asyncstep runs "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"unsupported activation {self.hidden_act!r} (only silu)")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"config: head_dim must be even for rotary, got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> ModelArchConfig:
        """Build from an HF ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        archs = cfg.get("architectures") or []
        if not archs:
            model_type = cfg.get("model_type")
            guess = {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
            }.get(str(model_type))
            if guess is None:
                raise UnsupportedModelError(
                    f"config names no architecture (model_type {model_type!r})"
                )
            archs = [guess]
        arch = str(archs[0])
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; asyncstep runs "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            n_kv = int(cfg.get("num_key_value_heads") or n_heads)
            head_dim = cfg.get("head_dim") or (hidden // n_heads if n_heads else 0)
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            rope_scaling = rope if rope and rope_type != "default" else None
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            family = ARCHITECTURES[arch]
            config = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=n_kv,
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                hidden_act=str(cfg.get("hidden_act", "silu")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config: missing or invalid field: {exc}") from None
        config.validate()
        return config
