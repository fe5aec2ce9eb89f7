"""The mixture-of-experts families on the Llama family's attention and
decoder machinery (:mod:`asyncstep.models.llama`): Qwen3-MoE (per-head q/k
RMSNorm, ``norm_topk_prob`` from its config, dense MLP layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say), Mixtral (top-k weights
always renormalised) and OLMoE (q/k RMSNorm over the whole q and k
projections). Their decoder layers swap the MLP for a
:class:`~asyncstep.models.layers.moe.SparseMoeBlock`; tensor and pipeline
parallelism are the Llama family's (experts split along their intermediate
dimension), or with expert parallelism each rank holds its experts whole
(:mod:`asyncstep.models.layers.moe`).

Checkpoints name each expert's projections apart
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``): they load into the layer's
``mlp.experts.w13_weight`` / ``w2_weight`` (:meth:`MoeForCausalLM.param_target`).
An op set's whole-stack step path runs them where it takes MoE layers (the
CPU's float32 stack: :mod:`asyncstep.ops.cpu.f32_stack`); else layer by layer.

May import torch, :mod:`asyncstep.channels`, the model config, layers and
:mod:`asyncstep.models.llama`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from asyncstep.channels import get_ep_group, get_tp_group
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.layers.moe import SparseMoeBlock, SparseMoeStage
from asyncstep.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from asyncstep.ops.attention import AttentionMetadata
from asyncstep.ops.base import RotaryCosSin
from asyncstep.ops.slot import OpSetSlot

__all__ = [
    "MixtralForCausalLM",
    "MoeDecoderLayer",
    "MoeForCausalLM",
    "OlmoeForCausalLM",
    "Qwen3MoeForCausalLM",
]

#: A checkpoint's expert projection, once its block is named ``mlp``:
#: (layer prefix, expert id, projection name).
_EXPERT_NAME = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
#: The experts' parameters: (layer prefix, ``w13`` or ``w2``).
_EXPERT_PARAM = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(w13|w2)_weight")


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose feed-forward is a :class:`MoeMLP` where
    the config makes the layer a MoE layer (else the dense MLP)."""

    @property
    def expert_parallel(self) -> bool:
        """Whether the feed-forward is an expert-parallel MoE block (then
        :meth:`begin_ep` runs the layer in stages)."""
        return isinstance(self.mlp, SparseMoeBlock) and self.mlp.experts.use_ep

    def begin_ep(
        self,
        cos_sin: RotaryCosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[SparseMoeStage, torch.Tensor]:
        """The layer up to its experts' dispatch (an expert-parallel layer):
        the MoE stage begun (:meth:`SparseMoeBlock.begin_ep`) and the residual."""
        assert isinstance(self.mlp, SparseMoeBlock)
        q, k, v, residual = self.pre_attention(cos_sin, hidden, residual)
        x, residual = self.pre_mlp(self.self_attn.attn(q, k, v, meta), residual)
        return self.mlp.begin_ep(x), residual

    def make_mlp(
        self,
        config: ModelArchConfig,
        layer_idx: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
        ops: OpSetSlot,
    ) -> nn.Module:
        if not config.is_moe_layer(layer_idx):
            return super().make_mlp(config, layer_idx, dtype, sequence_parallel, ops)
        return MoeMLP(config, dtype, sequence_parallel, ops)


class MoeMLP(SparseMoeBlock):
    """A MoE layer's feed-forward built from the model config (in
    :class:`~asyncstep.models.llama.LlamaMLP`'s place, with its arguments):
    the config's experts, router scoring, ``norm_topk_prob`` (whether the
    top-k weights are renormalised) and expert activation. A family whose
    block carries biases sets :attr:`biased`."""

    #: Whether the router and the experts carry biases (gpt-oss's).
    biased: bool = False

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        ops: OpSetSlot | None = None,
    ) -> None:
        super().__init__(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            scoring_func=config.scoring_func,
            sequence_parallel=sequence_parallel,
            params_dtype=dtype,
            ops=ops,
            bias=self.biased,
            activation=config.moe_activation,
        )


class MoeForCausalLM(LlamaForCausalLM):
    """A MoE family's causal LM: the Llama family's, its MoE layers' expert
    weights loaded from per-expert checkpoint names."""

    decoder_layer: type[LlamaDecoderLayer] = MoeDecoderLayer
    #: :meth:`step_expert_tokens`'s last total.
    _expert_tokens_seen: torch.Tensor | None = None

    def expert_load(self, *, reset: bool = False) -> dict[int, list[int]]:
        """Load balance: for each MoE layer of this stage (by its index in
        the model), the token rows routed to each expert since the model was
        built or the count last reset (every TP rank routes every row, so
        its ranks count alike, and under expert parallelism every rank counts
        the whole group's rows; padding rows count too). Reads the device's
        counters (a sync): call it between steps."""
        load: dict[int, list[int]] = {}
        for i, layer in enumerate(self.model.stage_layers(), self.model.start_layer):
            if isinstance(layer.mlp, SparseMoeBlock):
                counts = layer.mlp.experts.tokens_per_expert
                load[i] = counts.tolist()
                if reset:
                    counts.zero_()
        if reset:
            self._expert_tokens_seen = None
        return load

    def step_expert_tokens(self) -> torch.Tensor | None:
        """The rows routed to each expert since the last call, summed over
        this stage's MoE layers (``[num_experts]`` int64 on the device, no
        host sync: read it once the step's output is on the host); None
        where the stage has no MoE layer. The layers' own counts
        (:meth:`expert_load`) go on."""
        counts = [
            layer.mlp.experts.tokens_per_expert
            for layer in self.model.stage_layers()
            if isinstance(layer.mlp, SparseMoeBlock)
        ]
        if not counts:
            return None
        total = torch.stack(counts).sum(dim=0)
        seen = getattr(self, "_expert_tokens_seen", None)
        self._expert_tokens_seen = total
        return total if seen is None else total - seen

    def param_target(self, name: str) -> tuple[str, Any]:
        """An expert projection's parameter and ``(expert id, w1 | w3 | w2)``;
        other names as the Llama family's (the block renamed ``mlp``)."""
        block, gate, up, down = self.config.expert_weight_names
        if block != "mlp":
            name = name.replace(f".{block}.", ".mlp.")
        match = _EXPERT_NAME.fullmatch(name)
        kind = {gate: "w1", up: "w3", down: "w2"}.get(match[3]) if match else None
        if match is None or kind is None:
            return super().param_target(name)
        param = "w2_weight" if kind == "w2" else "w13_weight"
        return f"{match[1]}.mlp.experts.{param}", (int(match[2]), kind)

    def checkpoint_names(self, param_name: str) -> list[str]:
        block, gate, up, down = self.config.expert_weight_names
        match = _EXPERT_PARAM.fullmatch(param_name)
        if match is None:
            names = super().checkpoint_names(param_name)
            return [n.replace(".mlp.", f".{block}.") for n in names]
        projections = (gate, up) if match[2] == "w13" else (down,)
        ep = get_ep_group()  # under expert parallelism: this rank's experts
        per_rank = self.config.num_experts // ep.world_size
        start = ep.rank_in_group * per_rank
        return [
            f"{match[1]}.{block}.experts.{e}.{p}.weight"
            for e in range(start, start + per_rank)
            for p in projections
        ]


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``)."""


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral (``MixtralForCausalLM``)."""


class OlmoeAttention(LlamaAttention):
    """OLMoE's attention: q and k RMSNormed over the whole projection (every
    head at once, weights of ``q_size`` / ``kv_size``: the config's
    ``qk_norm_per_head`` is false). Under tensor parallelism each rank
    all-gathers its q and k columns, norms the whole rows and keeps its own
    columns (as vLLM's OLMoE)."""

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.q_norm is not None and self.k_norm is not None
        tp = get_tp_group()
        if tp.world_size == 1:
            return self.q_norm(q), self.k_norm(k)
        q_full = self.q_norm(tp.all_gather(q, dim=-1))
        k_full = self.k_norm(tp.all_gather(k, dim=-1))
        rank = tp.rank_in_group
        return (
            q_full.narrow(-1, rank * self.q_size, self.q_size),
            k_full.narrow(-1, rank * self.kv_size, self.kv_size),
        )


class OlmoeDecoderLayer(MoeDecoderLayer):
    attention_class: type[LlamaAttention] = OlmoeAttention


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE (``OlmoeForCausalLM``)."""

    decoder_layer = OlmoeDecoderLayer
