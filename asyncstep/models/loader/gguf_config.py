"""A GGUF file's metadata (:class:`GGUFMetadata`): its typed values (an
error names the file and the key) and the :class:`ModelArchConfig` they
describe, per architecture, as llama.cpp reads them.

What llama.cpp hard-codes for an architecture rather than writing it, read
as llama.cpp reads it: Gemma 3's every sixth layer full (the others sliding
when ``gemma3.attention.sliding_window`` is set; without it every layer is
full, on one rotary), its sliding layers' rotary base 10000 (or
``gemma3.rope.freq_base_swa``), its ``query_pre_attn_scalar`` the head
size (``hidden / heads`` for the 62-layer 27B), ``gelu_pytorch_tanh``;
gpt-oss's even layers sliding, its YaRN not truncated (its HF config's;
``rope.scaling.yarn_beta_fast`` / ``_slow`` read where given, as for every
architecture), its router's top-k logits softmaxed, its experts swigluoai.

Imports gguf, :mod:`asyncstep.errors`, :mod:`asyncstep.models.config`,
:mod:`asyncstep.models.limits` and :mod:`asyncstep.models.loader.gguf_names`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from asyncstep.errors import ModelLoadError
from asyncstep.models.config import (
    ARCHITECTURES,
    FULL_ATTENTION,
    MOE_FAMILIES,
    SLIDING_ATTENTION,
    ModelArchConfig,
)
from asyncstep.models.limits import is_int
from asyncstep.models.loader.gguf_names import GGUF_ARCHITECTURES, GGUF_LLAMA_MOE

__all__ = ["GEMMA3_27B_LAYERS", "GEMMA3_SLIDING_PATTERN", "GGUFMetadata"]

#: Gemma 3: every sixth layer full (llama.cpp's ``set_swa_pattern(6)``); the
#: 27B (62 layers) scales its queries by ``hidden / heads``, not the head size.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_27B_LAYERS = 62


class GGUFMetadata:
    """The metadata of the GGUF file at ``path``, read by ``reader`` (its
    :attr:`arch`: ``general.architecture``, which it must hold)."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self.reader, self.path = reader, path
        self.arch = self._metadata_str("general.architecture")

    # -- metadata ---------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar or string metadata value (arrays: their length is not read here)."""
        field = self.reader.fields.get(key)
        if field is None or not field.types:
            return default
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            raise ModelLoadError(f"{self.path}: GGUF metadata {key} is an array, expected a value")
        value = field.parts[field.data[0]]
        if kind == gguf.GGUFValueType.STRING:
            return bytes(value).decode("utf-8", errors="replace")
        return value.tolist()[0]

    def _metadata_str(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key}")
        return value

    def _metadata_int(self, key: str, default: int | None = None) -> int:
        """``<arch>.<key>``, which must be an integer (bounded later, by ``validate``)."""
        full_key = f"{self.arch}.{key}"
        value = self.get(full_key, default)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {full_key}")
        if not is_int(value):
            raise ModelLoadError(
                f"{self.path}: GGUF metadata {full_key} must be an integer, got {value!r}"
            )
        return int(value)

    def _metadata_float(self, key: str, default: float) -> float:
        """``<arch>.<key>``, which must be a number (checked finite by ``validate``)."""
        full_key = f"{self.arch}.{key}"
        value = self.get(full_key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(
                f"{self.path}: GGUF metadata {full_key} must be a number, got {value!r}"
            )
        return float(value)

    def array_length(self, key: str) -> int | None:
        field = self.reader.fields.get(key)
        if field is None or field.types[:1] != [gguf.GGUFValueType.ARRAY]:
            return None
        # CheckedReader keeps an array as [..., item type, length, items]; data -> items.
        return int(field.parts[field.data[0] - 1][0])

    # -- config -----------------------------------------------------------------------------

    def _vocab_size(self) -> int:
        vocab = self.get(f"{self.arch}.vocab_size")
        if vocab is not None:
            return self._metadata_int("vocab_size")
        n_tokens = self.array_length("tokenizer.ggml.tokens")
        if n_tokens:
            return n_tokens
        for tensor in self.reader.tensors:
            if tensor.name == "token_embd.weight":
                return int(tensor.shape[-1])
        raise ModelLoadError(f"{self.path}: GGUF file gives no vocabulary size")

    def _rope_scaling(self) -> dict[str, Any] | None:
        arch = self.arch
        kind = self.get(f"{arch}.rope.scaling.type")
        factor = self.get(f"{arch}.rope.scaling.factor")
        if kind is None and self.get(f"{arch}.rope.scale_linear") is not None:
            kind, factor = "linear", self.get(f"{arch}.rope.scale_linear")
        if kind in (None, "none") or not factor:
            return None
        if not isinstance(kind, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata {arch}.rope.scaling.type is no name")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
        original = self.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        for key in ("beta_fast", "beta_slow"):
            value = self.get(f"{arch}.rope.scaling.yarn_{key}")
            if value is not None and kind == "yarn":
                scaling[key] = value
        return scaling  # its fields are type-checked by ModelArchConfig.validate

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.get(f"tokenizer.ggml.{key}")
            if is_int(value) and value not in ids:
                ids.append(value)
        return tuple(ids)

    def _sliding_window(self) -> int | None:
        """``<arch>.attention.sliding_window`` (every layer's), where present."""
        if self.get(f"{self.arch}.attention.sliding_window") is None:
            return None
        return self._metadata_int("attention.sliding_window")

    def config(self) -> ModelArchConfig:
        """The model's config, as llama.cpp reads the file (the module doc);
        validated."""
        hidden = self._metadata_int("embedding_length")
        n_heads = self._metadata_int("attention.head_count")
        n_kv = self._metadata_int("attention.head_count_kv", n_heads)
        head_dim = self._metadata_int("attention.key_length", hidden // max(n_heads, 1))
        gguf_names = {tensor.name for tensor in self.reader.tensors}
        architecture = GGUF_ARCHITECTURES[self.arch]
        if self.arch == "llama" and self.get("llama.expert_count"):
            architecture = GGUF_LLAMA_MOE
        ffn = self._metadata_int("feed_forward_length")
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=self._vocab_size(),
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=self._metadata_int("block_count"),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=self._metadata_float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self._metadata_float("rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self._metadata_int("context_length", 4096),
            tie_word_embeddings="output.weight" not in gguf_names,
            attention_bias="blk.0.attn_q.bias" in gguf_names,
            qk_norm=self.arch in ("qwen3", "qwen3moe", "olmoe"),
            qk_norm_per_head=self.arch != "olmoe",
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self._eos_token_ids(),
            sliding_window=self._sliding_window(),
            **self._moe_fields(architecture, ffn),
        )
        if self.arch == "gemma3":
            fields |= self._gemma3_fields(fields)
        elif self.arch == "gpt-oss":
            fields |= self._gpt_oss_fields(fields)
        config = ModelArchConfig(**fields)
        try:
            config.validate()
        except ModelLoadError as exc:
            raise type(exc)(f"{self.path}: {exc}") from None
        return config

    def _gemma3_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Gemma 3's fields, as llama.cpp reads a ``gemma3`` file (the module doc)."""
        layers, window = fields["num_hidden_layers"], fields["sliding_window"]
        types: tuple[str, ...] = ()
        if window:
            types = tuple(
                FULL_ATTENTION if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else SLIDING_ATTENTION
                for i in range(layers)
            )
        scalar = fields["head_dim"]
        if layers == GEMMA3_27B_LAYERS:
            scalar = fields["hidden_size"] // max(fields["num_attention_heads"], 1)
        arch = self.arch
        return {
            "hidden_act": "gelu_pytorch_tanh",
            "qk_norm": True,
            "sliding_window": window or None,
            "layer_types": types,
            "query_pre_attn_scalar": float(scalar),
            "rope_local_base_freq": self._metadata_float("rope.freq_base_swa", 10000.0)
            if window
            else None,
            "max_position_embeddings": self._metadata_int("context_length", 131072),
            "final_logit_softcapping": self.get(f"{arch}.final_logit_softcapping"),
            "attn_logit_softcapping": self.get(f"{arch}.attn_logit_softcapping"),
        }

    def _gpt_oss_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """gpt-oss's fields, as llama.cpp reads a ``gpt-oss`` file (the module doc)."""
        layers = fields["num_hidden_layers"]
        rope = fields["rope_scaling"]
        if rope is not None and rope["rope_type"] == "yarn":
            rope = rope | {"truncate": False}
        return {
            "sliding_window": self._metadata_int("attention.sliding_window"),
            "layer_types": tuple(
                SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)
            ),
            "rope_scaling": rope,
            "attention_sinks": True,
            "scoring_func": "topk_softmax",
            "moe_activation": "swigluoai",
            "norm_topk_prob": False,
        }

    def _moe_fields(self, architecture: str, ffn: int) -> dict[str, Any]:
        """A MoE architecture's expert fields (bounded by ``validate``): the
        expert counts, each expert's width (``expert_feed_forward_length``,
        else the feed-forward length) and ``expert_weights_norm`` (else the
        family's: OLMoE does not renormalise, Qwen3-MoE and Mixtral do)."""
        family = ARCHITECTURES[architecture]
        if family not in MOE_FAMILIES:
            return {}
        norm = self.get(f"{self.arch}.expert_weights_norm", family != "olmoe")
        return {
            "num_experts": self._metadata_int("expert_count"),
            "num_experts_per_tok": self._metadata_int("expert_used_count"),
            "moe_intermediate_size": self._metadata_int("expert_feed_forward_length", ffn),
            "norm_topk_prob": norm,
        }
