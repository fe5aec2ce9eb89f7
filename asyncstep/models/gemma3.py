"""Gemma 3's text model (``Gemma3ForCausalLM``) on the Llama family's
attention, decoder and model machinery (:mod:`asyncstep.models.llama`),
through its hooks.

What differs from a Llama, as transformers' ``modeling_gemma3`` computes it:

- every RMSNorm is Gemma's, ``x * rsqrt(mean(x^2) + eps) * (1 + w)``: the
  checkpoint's ``w`` loads as ``1 + w`` (:class:`GemmaRMSNorm`), so the op
  set's norms (fused kernels included) run it unchanged;
- four norms per layer, a sandwich: ``input_layernorm`` before the attention,
  ``post_attention_layernorm`` on its output before the residual add,
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the
  MLP; per-head q/k norms (Gemma's);
- the embeddings scaled by ``sqrt(hidden_size)``, rounded to the activations'
  dtype first;
- attention scale ``query_pre_attn_scalar ** -0.5``;
- MLP ``gelu_pytorch_tanh(gate) * up`` (torch's ``gelu(approximate="tanh")``:
  no op-set kernel);
- ``layer_types``: sliding layers of ``sliding_window`` tokens (every
  ``sliding_window_pattern``-th layer full), their rotary of base
  ``rope_local_base_freq`` without scaling; the full layers' of
  ``rope_theta`` and ``rope_scaling``. The model's forward looks up the full
  layers' rotation once per step; a sliding layer looks its own up from the
  step's positions (so the runner's piecewise graphs and micro-batches,
  which pass every layer the model's rotation, stay right);
- tied embeddings (the config's default).

Soft caps (``final_logit_softcapping``, ``attn_logit_softcapping``: null in
Gemma 3) are refused at the door (:class:`~asyncstep.models.config.ModelArchConfig`).
No op set's whole-stack step path is asked for (they read Llama layers): the
layers run one by one; packed weights (``weight_packing``) apply to the
linear layers as to a Llama's. Tensor and pipeline parallelism (sequence
parallelism too) are the Llama family's.

May import torch, the model config, layers and :mod:`asyncstep.models.llama`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from asyncstep.datatypes import IntermediateTensors
from asyncstep.models.config import SLIDING_ATTENTION, ModelArchConfig
from asyncstep.models.layers.norm import GemmaRMSNorm, RMSNorm
from asyncstep.models.layers.rotary import RotaryCosSin, RotaryEmbedding
from asyncstep.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)

__all__ = ["Gemma3DecoderLayer", "Gemma3ForCausalLM", "Gemma3Model"]


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's per-head q/k norms (the scale is the
    config's :attr:`~asyncstep.models.config.ModelArchConfig.attention_scale`)."""

    norm_class: type[RMSNorm] = GemmaRMSNorm


class Gemma3MLP(LlamaMLP):
    """``down(gelu_tanh(gate) * up)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """The sandwich: the attention's and the MLP's outputs each normed
    before their residual add. A sliding layer rotates with its own rotary
    (:meth:`pre_attention`)."""

    norm_class: type[RMSNorm] = GemmaRMSNorm
    attention_class: type[LlamaAttention] = Gemma3Attention
    mlp_class: type[nn.Module] = Gemma3MLP

    def __init__(
        self,
        config: ModelArchConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        layer_idx: int = 0,
    ):
        super().__init__(config, rotary, dtype, sequence_parallel, layer_idx)
        ops = rotary.ops
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, ops)
        #: Whether the layer rotates with the sliding layers' rotary (not the model's).
        self.local_rotation = is_sliding_layer(config, layer_idx)

    def pre_attention(
        self,
        cos_sin: RotaryCosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        own_residual: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """As Llama's; ``cos_sin`` is the model's (full layers') rotation: a
        sliding layer looks its own up at the same positions."""
        if self.local_rotation:
            cos_sin = self.self_attn.rotary[0].cos_sin(cos_sin.positions, hidden.dtype)
        return super().pre_attention(cos_sin, hidden, residual, own_residual=own_residual)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``post_attention_layernorm(o_proj)`` added to the stream, then
        ``post_feedforward_layernorm(mlp(pre_feedforward_layernorm(stream)))``
        (added by the next norm)."""
        hidden = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        hidden, residual = self.pre_feedforward_layernorm.forward_residual(
            hidden, residual, own_residual=True
        )
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(LlamaModel):
    """Llama's model with Gemma's final norm, the embeddings scaled by
    ``sqrt(hidden_size)`` and a second rotary (:attr:`local_rotary`) for the
    sliding layers."""

    norm_class: type[RMSNorm] = GemmaRMSNorm

    def make_rotary(self, config: ModelArchConfig) -> RotaryEmbedding:
        #: The sliding layers' rotary: base ``rope_local_base_freq``, no scaling.
        self.local_rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            local_base(config),
            None,
            self.ops,
        )
        self.sliding_layers = frozenset(
            i for i in range(config.num_hidden_layers) if is_sliding_layer(config, i)
        )
        self.embed_scale = config.hidden_size**0.5
        return super().make_rotary(config)

    def layer_rotary(self, layer_idx: int) -> RotaryEmbedding:
        return self.local_rotary if layer_idx in self.sliding_layers else self.rotary

    def begin(
        self, input_ids: torch.Tensor, intermediate_tensors: IntermediateTensors | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, residual = super().begin(input_ids, intermediate_tensors)
        if self.embed_tokens is None:
            return hidden, residual
        return hidden * rounded(self.embed_scale, hidden.dtype), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (``Gemma3ForCausalLM``): see the module doc."""

    decoder_layer: type[LlamaDecoderLayer] = Gemma3DecoderLayer
    decoder_model: type[LlamaModel] = Gemma3Model
    takes_step_path = False


def is_sliding_layer(config: ModelArchConfig, layer_idx: int) -> bool:
    """Whether ``layer_types`` names layer ``layer_idx`` sliding (its rotary is
    the local one, whether or not a window is set)."""
    return bool(config.layer_types) and config.layer_types[layer_idx] == SLIDING_ATTENTION


def local_base(config: ModelArchConfig) -> float:
    """The sliding layers' rotary base (``rope_theta`` where none is given)."""
    base = config.rope_local_base_freq
    return config.rope_theta if base is None else base


@functools.cache
def rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (as transformers casts the embedding scale)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))
