"""The Llama decoder layer (vLLM's ``LlamaDecoderLayer``): its attention
(:class:`LlamaAttention`: q/k/v projections, the q/k norms of Qwen3, rotary,
the paged attention, o_proj), its MLP (:class:`LlamaMLP`: silu * up) and the
hooks other families set or override: the layer's ``attention_class`` /
``mlp_class`` / :meth:`LlamaDecoderLayer.make_mlp`, the attention's
``o_proj_bias``, the norms' ``norm_class``, and the step's pieces
:meth:`LlamaDecoderLayer.pre_attention` / ``pre_mlp`` / ``post_attention``
that whole-stack paths and micro-batches call. The model around the layers
is :mod:`asyncstep.models.llama`'s.

Under sequence parallelism a layer's ``hidden`` and ``residual`` are this
rank's token shard (the module doc of :mod:`asyncstep.models.llama`).
May import torch, ``asyncstep.ops`` (the op-set slot, the attention shape's ``QkNorm``),
:mod:`asyncstep.models.config` and the layers of :mod:`asyncstep.models.layers`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from asyncstep.models.config import ModelArchConfig
from asyncstep.models.layers.attention import Attention, AttentionMetadata
from asyncstep.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from asyncstep.models.layers.norm import RMSNorm
from asyncstep.models.layers.rotary import RotaryCosSin, RotaryEmbedding
from asyncstep.ops.attention import QkNorm
from asyncstep.ops.slot import OpSetSlot


class LlamaAttention(nn.Module):
    """q/k/v projections, q/k norms (Qwen3; OLMoE's over the whole
    projections, as the config's ``qk_norm_per_head`` says), rotary, the
    paged attention and o_proj. A family whose q/k norms differ names its
    :attr:`norm_class`; one whose o_proj is biased sets :attr:`o_proj_bias`."""

    #: The q/k norms' class.
    norm_class: type[RMSNorm] = RMSNorm
    #: Whether o_proj takes the config's ``attention_bias`` too (gpt-oss);
    #: else only q/k/v do.
    o_proj_bias: bool = False

    def __init__(
        self,
        config: ModelArchConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        layer_idx: int = 0,
    ):
        super().__init__()
        ops = rotary.ops
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            sequence_parallel=sequence_parallel,
            params_dtype=dtype,
            ops=ops,
        )
        self.o_proj = RowParallelLinear(
            config.q_size,
            config.hidden_size,
            bias=self.o_proj_bias and config.attention_bias,
            sequence_parallel=sequence_parallel,
            params_dtype=dtype,
            ops=ops,
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = config.head_dim
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            q_norm, k_norm = config.qk_norm_widths
            self.q_norm = self.norm_class(q_norm, config.rms_norm_eps, dtype, ops)
            self.k_norm = self.norm_class(k_norm, config.rms_norm_eps, dtype, ops)
        self.rotary = [rotary]  # a list: shared by every layer, not a submodule of each
        self.attn = Attention(
            self.qkv_proj.num_heads,
            config.head_dim,
            self.qkv_proj.num_kv_heads,
            scale=config.attention_scale,
            rotary=rotary,
            sliding_window=config.layer_window(layer_idx),
            layer_idx=layer_idx,
        )
        if self.q_norm is not None and self.k_norm is not None and config.qk_norm_per_head:
            # An op set's attention may apply the per-head norms itself (norms_qk).
            qk_norm = QkNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            self.attn.shape = dataclasses.replace(self.attn.shape, qk_norm=qk_norm)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through their RMSNorms (Qwen3: over each head), the op
        set's ``qk_rms_norm`` (one launch on CUDA)."""
        assert self.q_norm is not None and self.k_norm is not None
        q_norm, k_norm = self.q_norm, self.k_norm
        return q_norm.ops.ops.qk_rms_norm(
            q,
            k,
            q_norm.weight,
            k_norm.weight,
            q_norm.eps,
            float32_residual=q_norm.float32_residual,
        )

    def qkv(
        self, cos_sin: RotaryCosSin, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's inputs: projected, normed (Qwen3) and rotated q, k, v."""
        return self.split_qkv(cos_sin, self.qkv_proj(hidden))

    def split_qkv(
        self, cos_sin: RotaryCosSin, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`qkv` of the projection's output ``qkv``."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        if self.q_norm is not None and not self.attn.norms_qk:
            q, k = self.norm_qk(q, k)
        if not self.attn.rotates:  # else rotated by the attention's KV store
            q, k = self.rotary[0](cos_sin, q, k)
        return q, k, v

    def forward(
        self, cos_sin: RotaryCosSin, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv(cos_sin, hidden)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        ops: OpSetSlot | None = None,
    ):
        super().__init__()
        self.ops = ops or OpSetSlot()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            sequence_parallel=sequence_parallel,
            params_dtype=dtype,
            ops=self.ops,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            sequence_parallel=sequence_parallel,
            params_dtype=dtype,
            ops=self.ops,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Under sequence parallelism ``hidden`` and ``residual`` (in and out) are
    this rank's token shard; the projections gather and scatter the rows.
    A family whose attention or MLP differs names its :attr:`attention_class`
    / :attr:`mlp_class`, one whose feed-forward differs by layer overrides
    :meth:`make_mlp` (``layer_idx``: the layer's index in the whole model),
    and one whose norms differ names their :attr:`norm_class`."""

    #: The layer norms' class.
    norm_class: type[RMSNorm] = RMSNorm
    #: The attention's class.
    attention_class: type[LlamaAttention] = LlamaAttention
    #: The feed-forward's class (:meth:`make_mlp`'s), built as :class:`LlamaMLP` is.
    mlp_class: type[nn.Module] = LlamaMLP

    def __init__(
        self,
        config: ModelArchConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        layer_idx: int = 0,
    ):
        super().__init__()
        ops = rotary.ops
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.self_attn = self.attention_class(config, rotary, dtype, sequence_parallel, layer_idx)
        self.post_attention_layernorm = self.norm_class(
            config.hidden_size, config.rms_norm_eps, dtype, ops
        )
        self.mlp = self.make_mlp(config, layer_idx, dtype, sequence_parallel, ops)

    def make_mlp(
        self,
        config: ModelArchConfig,
        layer_idx: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
        ops: OpSetSlot,
    ) -> nn.Module:
        """The feed-forward: ``forward(x)`` of the normed hidden rows (a
        :attr:`mlp_class`)."""
        return self.mlp_class(config, dtype, sequence_parallel, ops)

    def pre_attention(
        self,
        cos_sin: RotaryCosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        own_residual: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Up to the attention: (q, k, v, residual). ``own_residual``: the
        caller gives ``residual`` up (an earlier layer's, read by no one
        else), so the norm may add into it in place."""
        hidden, residual = self.input_layernorm.forward_residual(
            hidden, residual, own_residual=own_residual
        )
        q, k, v = self.self_attn.qkv(cos_sin, hidden)
        return q, k, v, residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention's output on: (hidden, residual). ``residual``
        is :meth:`pre_attention`'s, the layer's own: the norm may add into it
        in place."""
        hidden, residual = self.pre_mlp(attn_out, residual)
        return self.mlp(hidden), residual

    def pre_mlp(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`post_attention` up to the feed-forward: (its input, the
        residual)."""
        hidden = self.self_attn.o_proj(attn_out)
        return self.post_attention_layernorm.forward_residual(hidden, residual, own_residual=True)

    def forward(
        self,
        cos_sin: RotaryCosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        *,
        own_residual: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``own_residual``: as :meth:`pre_attention`'s."""
        q, k, v, residual = self.pre_attention(cos_sin, hidden, residual, own_residual=own_residual)
        return self.post_attention(self.self_attn.attn(q, k, v, meta), residual)
