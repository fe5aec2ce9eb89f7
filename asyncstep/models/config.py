"""The architecture of a decoder-only model, read from an HF config or GGUF metadata.

:meth:`ModelArchConfig.validate` is the one gate every config passes before a
model is built from it: sizes are non-bool ints within the bounds of
:mod:`asyncstep.models.limits`, floats finite, flags bools, rope scaling of a
known type with typed fields, a mixture-of-experts config's expert
counts bounded and consistent (top-k within the experts, every MoE layer's
experts within :data:`~asyncstep.models.limits.MAX_EXPERT_LAYERS`), the
sliding window a positive int and ``layer_types`` one known name per
layer, Gemma's fields (``query_pre_attn_scalar``, ``rope_local_base_freq``,
the activation) bounded and its soft caps refused.
:meth:`ModelArchConfig.weight_shapes` gives the tensors (HF names, full
shapes) a checkpoint of the config must hold.

Sliding-window attention (transformers' semantics): a layer with window ``W``
lets the query at position ``p`` see the keys at positions ``p - W + 1 .. p``
(``W`` keys, itself included). :meth:`ModelArchConfig.layer_window` gives each
layer's ``W`` (None: full attention). An HF config's windows are read by
:mod:`asyncstep.models.hf_config` (each architecture's rule); GGUF's are
``{arch}.attention.sliding_window``, on every layer (Gemma 3's and gpt-oss's
on llama.cpp's patterns: :mod:`asyncstep.models.loader.gguf_config`).

The families asyncstep runs and their tables are in
:mod:`asyncstep.models.families`; the checks of the rope scaling and of the
layer types in :mod:`asyncstep.models.rope_scaling` and
:mod:`asyncstep.models.layer_types` (their names re-exported here). The HF
``config.json`` parsing is :func:`asyncstep.models.hf_config.parse_hf_config`'s,
above this module: it builds a :class:`ModelArchConfig` and calls
:meth:`~ModelArchConfig.validate`. May import only the standard library,
``asyncstep.errors``, :mod:`asyncstep.models.limits` and those three.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from asyncstep.errors import ConfigError, ModelLoadError, UnsupportedModelError
from asyncstep.models.families import (
    ACTIVATIONS,
    ARCHITECTURES,
    GEMMA_FAMILIES,
    MOE_ACTIVATIONS,
    MOE_FAMILIES,
    SCORING_FUNCS,
)
from asyncstep.models.layer_types import FULL_ATTENTION, SLIDING_ATTENTION, validate_layer_types
from asyncstep.models.limits import (
    MAX_CONTEXT_LENGTH,
    MAX_EXPERT_LAYERS,
    MAX_HEAD_DIM,
    MAX_HIDDEN_SIZE,
    MAX_INTERMEDIATE_SIZE,
    MAX_NUM_EXPERTS,
    MAX_NUM_HEADS,
    MAX_NUM_LAYERS,
    MAX_VOCAB_SIZE,
    bounded_float,
    bounded_int,
)
from asyncstep.models.rope_scaling import validate_rope_scaling

__all__ = [
    "ARCHITECTURES",
    "FULL_ATTENTION",
    "GEMMA_FAMILIES",
    "MAX_EOS_TOKENS",
    "MAX_TOKEN_ID",
    "MOE_FAMILIES",
    "SIZE_BOUNDS",
    "SLIDING_ATTENTION",
    "ModelArchConfig",
    "pp_layer_range",
    "validate_layer_types",
    "validate_rope_scaling",
]


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and options of a Llama-family model (Llama, Mistral, Qwen2, Qwen3),
    of the mixture-of-experts families built on its attention (Qwen3-MoE,
    Mixtral, OLMoE: ``num_experts`` > 0) and of Gemma 3's text model (its
    fields below: ``query_pre_attn_scalar`` .. ``attn_logit_softcapping``)."""

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
    #: RMSNorm on q and k before rotary (Qwen3, OLMoE).
    qk_norm: bool = False
    #: The q/k RMSNorm is over each head (Qwen3), or over the whole q and k
    #: projections (OLMoE: weights of ``q_size`` and ``kv_size``).
    qk_norm_per_head: bool = True
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: Mixture of experts (0: a dense model): experts of a MoE layer, how
    #: many each token takes, and each expert's intermediate size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    #: Renormalise a token's top-k router weights to sum to 1 (Mixtral
    #: always; Qwen3-MoE and OLMoE as their config says).
    norm_topk_prob: bool = False
    #: The router's scoring before its top-k
    #: (:data:`~asyncstep.models.families.SCORING_FUNCS`).
    scoring_func: str = "softmax"
    #: Qwen3-MoE: layer ``i`` is a MoE layer where ``(i + 1) %
    #: decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``;
    #: the others have a dense MLP of ``intermediate_size``.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    #: The attention window of the sliding layers, in tokens (None: none).
    sliding_window: int | None = None
    #: One of :data:`~asyncstep.models.layer_types.LAYER_TYPES` per layer;
    #: empty: every layer sliding where
    #: ``sliding_window`` is set, else full.
    layer_types: tuple[str, ...] = ()
    #: Gemma: the attention scale is ``query_pre_attn_scalar ** -0.5`` (None:
    #: ``head_dim ** -0.5``).
    query_pre_attn_scalar: float | None = None
    #: Gemma 3: the rotary base of the sliding layers (the full layers take
    #: ``rope_theta`` and ``rope_scaling``); None: every layer's is ``rope_theta``.
    rope_local_base_freq: float | None = None
    #: Gemma's tanh soft caps of the logits and of the attention scores
    #: (None: none; asyncstep runs none, and refuses a config that sets one).
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    #: gpt-oss: a learned sink logit per attention head (``self_attn.sinks``).
    attention_sinks: bool = False
    #: The experts' activation (:data:`~asyncstep.models.families.MOE_ACTIVATIONS`;
    #: gpt-oss: swigluoai).
    moe_activation: str = "silu"
    #: gpt-oss: the checkpoint stores the experts' projections as MXFP4
    #: (``{proj}_blocks`` / ``{proj}_scales``, :mod:`asyncstep.models.mxfp4`),
    #: kept packed on the CPU in float32, else dequantized at load.
    experts_mxfp4: bool = False

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers."""
        return self.family in MOE_FAMILIES

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has experts (else a dense MLP)."""
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_weight_names(self) -> tuple[str, str, str, str]:
        """The checkpoint's names of a MoE block: (its module, gate, up, down)."""
        return MOE_FAMILIES[self.family]

    @property
    def is_gemma(self) -> bool:
        """Whether the layers are Gemma's
        (:data:`~asyncstep.models.families.GEMMA_FAMILIES`)."""
        return self.family in GEMMA_FAMILIES

    @property
    def attention_scale(self) -> float:
        """The attention's softmax scale."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar**-0.5)
        return float(self.head_dim**-0.5)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """The q and k norms' widths: a head's, or (not ``qk_norm_per_head``)
        the whole q and k projections'."""
        if self.qk_norm_per_head:
            return self.head_dim, self.head_dim
        return self.q_size, self.kv_size

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens; None: full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """:meth:`layer_window` of every layer."""
        return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

    def replace(self, **changes: Any) -> ModelArchConfig:
        return dataclasses.replace(self, **changes)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF names and full shapes of every tensor a checkpoint of this model holds
        (``lm_head.weight`` only when the embeddings are not tied)."""
        h, q, kv, inter = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}"
            shapes |= {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (q, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, q),
            }
            if self.is_gemma:
                shapes |= {
                    f"{p}.pre_feedforward_layernorm.weight": (h,),
                    f"{p}.post_feedforward_layernorm.weight": (h,),
                }
            if self.family == "gpt_oss":
                shapes |= self._gpt_oss_shapes(p)
            elif self.is_moe_layer(i):
                shapes |= self._expert_shapes(p)
            else:
                shapes |= {
                    f"{p}.mlp.gate_proj.weight": (inter, h),
                    f"{p}.mlp.up_proj.weight": (inter, h),
                    f"{p}.mlp.down_proj.weight": (h, inter),
                }
            if self.attention_bias:
                shapes |= {
                    f"{p}.self_attn.q_proj.bias": (q,),
                    f"{p}.self_attn.k_proj.bias": (kv,),
                    f"{p}.self_attn.v_proj.bias": (kv,),
                }
            if self.qk_norm:
                q_norm, k_norm = self.qk_norm_widths
                shapes |= {
                    f"{p}.self_attn.q_norm.weight": (q_norm,),
                    f"{p}.self_attn.k_norm.weight": (k_norm,),
                }
        return shapes

    def _gpt_oss_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """A gpt-oss layer's router, experts (one tensor per projection; MXFP4
        ones as their uint8 blocks and scales), output bias and sinks
        (checkpoint names)."""
        h, inter, e = self.hidden_size, self.moe_intermediate_size, self.num_experts
        experts = f"{prefix}.mlp.experts"
        shapes: dict[str, tuple[int, ...]] = {
            f"{prefix}.mlp.router.weight": (e, h),
            f"{prefix}.mlp.router.bias": (e,),
            f"{experts}.gate_up_proj_bias": (e, 2 * inter),
            f"{experts}.down_proj_bias": (e, h),
            f"{prefix}.self_attn.sinks": (self.num_attention_heads,),
        }
        if not self.experts_mxfp4:
            shapes[f"{experts}.gate_up_proj"] = (e, h, 2 * inter)
            shapes[f"{experts}.down_proj"] = (e, inter, h)
            return shapes | self._o_bias_shape(prefix)
        for proj, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            shapes[f"{experts}.{proj}_blocks"] = (e, rows, cols // 32, 16)
            shapes[f"{experts}.{proj}_scales"] = (e, rows, cols // 32)
        return shapes | self._o_bias_shape(prefix)

    def _o_bias_shape(self, prefix: str) -> dict[str, tuple[int, ...]]:
        h = self.hidden_size
        return {f"{prefix}.self_attn.o_proj.bias": (h,)} if self.attention_bias else {}

    def _expert_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """A MoE layer's router and per-expert projections (checkpoint names)."""
        block, gate, up, down = self.expert_weight_names
        h, inter = self.hidden_size, self.moe_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            f"{prefix}.{block}.gate.weight": (self.num_experts, h)
        }
        for e in range(self.num_experts):
            expert = f"{prefix}.{block}.experts.{e}"
            shapes |= {
                f"{expert}.{gate}.weight": (inter, h),
                f"{expert}.{up}.weight": (inter, h),
                f"{expert}.{down}.weight": (h, inter),
            }
        return shapes

    def validate(self) -> None:
        """Raise a one-line error for a config no model can be built from: every
        size a bounded non-bool int, every float finite, every flag a bool."""
        if not isinstance(self.architecture, str) or self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; asyncstep runs "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        activations = ACTIVATIONS.get(self.family, ("silu",))
        if self.hidden_act not in activations:
            shown = repr(self.hidden_act)[:40]
            raise UnsupportedModelError(
                f"unsupported activation {shown} for {self.architecture} ({', '.join(activations)})"
            )
        for name, high in SIZE_BOUNDS.items():
            bounded_int(f"config: {name}", getattr(self, name), high)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"config: head_dim must be even for rotary, got {self.head_dim}")
        bounded_float("config: rms_norm_eps", self.rms_norm_eps, 1.0)
        bounded_float("config: rope_theta", self.rope_theta, math.inf)
        flags = ("tie_word_embeddings", "attention_bias", "qk_norm", "qk_norm_per_head")
        for flag in (*flags, "attention_sinks", "experts_mxfp4"):
            if not isinstance(getattr(self, flag), bool):
                raise ModelLoadError(f"config: {flag} must be true or false")
        self._validate_moe()
        self._validate_gemma()
        if self.bos_token_id is not None:
            bounded_int("config: bos_token_id", self.bos_token_id, MAX_TOKEN_ID, low=0)
        if not isinstance(self.eos_token_ids, tuple) or len(self.eos_token_ids) > MAX_EOS_TOKENS:
            raise ModelLoadError(
                f"config: eos_token_ids must be a tuple of at most {MAX_EOS_TOKENS} token ids"
            )
        for eos in self.eos_token_ids:
            bounded_int("config: eos_token_id", eos, MAX_TOKEN_ID, low=0)
        validate_rope_scaling(self.rope_scaling)
        self._validate_windows()

    def _validate_windows(self) -> None:
        if self.sliding_window is not None:
            bounded_int("config: sliding_window", self.sliding_window, MAX_CONTEXT_LENGTH)
        validate_layer_types(self.layer_types, self.num_hidden_layers)

    def _validate_gemma(self) -> None:
        """Gemma's fields bounded (another family has none); soft caps refused."""
        gemma_fields = ("query_pre_attn_scalar", "rope_local_base_freq")
        if not self.is_gemma and any(getattr(self, f) is not None for f in gemma_fields):
            raise ModelLoadError(f"config: {self.architecture} takes no Gemma fields")
        for name in gemma_fields:
            if getattr(self, name) is not None:
                bounded_float(f"config: {name}", getattr(self, name), math.inf)
        for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
            value = getattr(self, cap)
            if value is not None:
                bounded_float(f"config: {cap}", value, math.inf)
                raise UnsupportedModelError(f"unsupported option {cap} (only null)")

    def _validate_moe(self) -> None:
        """A MoE family's expert fields bounded and consistent; a dense one has none."""
        if not self.is_moe:
            if self.num_experts or self.num_experts_per_tok or self.moe_intermediate_size:
                raise ModelLoadError(f"config: {self.architecture} takes no experts")
            if self.moe_activation != "silu":
                raise ModelLoadError(f"config: {self.architecture} has no expert activation")
            return
        bounded_int("config: num_experts", self.num_experts, MAX_NUM_EXPERTS)
        bounded_int("config: num_experts_per_tok", self.num_experts_per_tok, self.num_experts)
        bounded_int(
            "config: moe_intermediate_size", self.moe_intermediate_size, MAX_INTERMEDIATE_SIZE
        )
        bounded_int("config: decoder_sparse_step", self.decoder_sparse_step, MAX_NUM_LAYERS)
        if not isinstance(self.norm_topk_prob, bool):
            raise ModelLoadError("config: norm_topk_prob must be true or false")
        if self.scoring_func not in SCORING_FUNCS:
            raise UnsupportedModelError(
                f"unsupported router scoring {self.scoring_func!r} ({', '.join(SCORING_FUNCS)})"
            )
        if self.moe_activation not in MOE_ACTIVATIONS:
            shown = repr(self.moe_activation)[:40]
            raise UnsupportedModelError(
                f"unsupported expert activation {shown} ({', '.join(MOE_ACTIVATIONS)})"
            )
        layers = self.mlp_only_layers
        if not isinstance(layers, tuple) or len(layers) > self.num_hidden_layers:
            raise ModelLoadError("config: mlp_only_layers must be a list of layer indices")
        for i in layers:
            bounded_int("config: mlp_only_layers", i, self.num_hidden_layers - 1, low=0)
        moe_layers = sum(map(self.is_moe_layer, range(self.num_hidden_layers)))
        if moe_layers * self.num_experts > MAX_EXPERT_LAYERS:
            raise ModelLoadError(
                f"config: {moe_layers} MoE layers of {self.num_experts} experts, more than "
                f"{MAX_EXPERT_LAYERS} experts in all"
            )


#: Each size field of :class:`ModelArchConfig` (and of an HF config) -> its upper bound.
SIZE_BOUNDS: dict[str, int] = {
    "vocab_size": MAX_VOCAB_SIZE,
    "hidden_size": MAX_HIDDEN_SIZE,
    "intermediate_size": MAX_INTERMEDIATE_SIZE,
    "num_hidden_layers": MAX_NUM_LAYERS,
    "num_attention_heads": MAX_NUM_HEADS,
    "num_key_value_heads": MAX_NUM_HEADS,
    "head_dim": MAX_HEAD_DIM,
    "max_position_embeddings": MAX_CONTEXT_LENGTH,
}
#: Token ids fit an int32 (the runner's token tables).
MAX_TOKEN_ID = 2**31 - 1
#: End-of-sequence ids a config may list (real ones: 1 to 4).
MAX_EOS_TOKENS = 256


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers of one stage, split evenly; a remainder goes to the stages
    before the last (which also carries the LM head)."""
    if pp_size > num_layers:
        raise ConfigError(
            f"pipeline_parallel_size ({pp_size}) is larger than the layer count ({num_layers})"
        )
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i if pp_size > 1 else 0] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
