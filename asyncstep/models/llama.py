"""The Llama family: Llama 2/3, Mistral, SmolLM2 (Llama), Qwen2 (q/k/v bias)
and Qwen3 (per-head q/k RMSNorm), with tensor- and pipeline-parallel layers.
Other families reuse its attention, decoder layer and model through their
hooks (:attr:`LlamaDecoderLayer.attention_class` / ``mlp_class`` / ``make_mlp``,
:attr:`LlamaForCausalLM.decoder_layer`, :meth:`LlamaForCausalLM.param_target`):
the mixture-of-experts families of :mod:`asyncstep.models.moe`; and Gemma 3
(:mod:`asyncstep.models.gemma3`) through the norms' ``norm_class``, the
model's :attr:`LlamaForCausalLM.decoder_model` (its
:meth:`LlamaModel.make_rotary` / :meth:`LlamaModel.layer_rotary` /
:meth:`LlamaModel.begin`) and :attr:`LlamaForCausalLM.takes_step_path`.
The decoder layer, its attention and MLP (and their hooks) are
:mod:`asyncstep.models.llama_decoder_layer`'s, handed on here; this module
holds the model around them and its weights' loading.

``forward`` takes a flat batch of tokens (no batch dimension): ``input_ids``
and ``positions`` of every scheduled token of every request (then padding
tokens, under sequence parallelism), and the step's
:class:`AttentionMetadata`. A pipeline stage owns layers
``[start_layer, end_layer)``; the first embeds, the last normalises and owns
the LM head; the others exchange ``IntermediateTensors``.

With ``sequence_parallel`` (Megatron-SP) the residual stream between the
tensor-parallel layers is split along tokens: each TP rank holds
``num_tokens / tp_size`` rows, and the norms and residual adds run on that
shard. The column-parallel layers all-gather their input rows, the
row-parallel layers and the embedding reduce-scatter instead of all-reducing,
and the last stage all-gathers the final norm's output, so ``forward`` still
returns every token's hidden state. The step's token count must then be a
multiple of ``tp_size`` (the runner pads the step to
:attr:`LlamaForCausalLM.num_tokens_multiple`); the intermediate tensors
between pipeline stages are the token shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from asyncstep.channels import get_pp_group, get_tp_group
from asyncstep.datatypes import IntermediateTensors
from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.config import ModelArchConfig, pp_layer_range
from asyncstep.models.layers.attention import Attention, AttentionMetadata
from asyncstep.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from asyncstep.models.layers.linear import gather_tokens
from asyncstep.models.layers.norm import RMSNorm
from asyncstep.models.layers.rotary import RotaryEmbedding
from asyncstep.models.llama_decoder_layer import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from asyncstep.ops.base import OpSet, StepPath
from asyncstep.ops.slot import OpSetSlot

#: The decoder layer's classes are handed on from
#: :mod:`asyncstep.models.llama_decoder_layer`, where they live.
__all__ = [
    "STACKED_PARAMS",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
]

# Checkpoint names folded into our fused parameters: (ours, theirs, shard id).
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


class LlamaModel(nn.Module):
    """A pipeline stage's embedding, decoder layers and final norm. A family
    whose model differs overrides :meth:`make_rotary` / :meth:`layer_rotary`
    (a rotary per layer type), :meth:`begin` (the embedding's scale) or
    names its final norm's :attr:`norm_class`."""

    #: The final norm's class.
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer,
    ):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = pp_layer_range(
            config.num_hidden_layers, pp.rank_in_group, pp.world_size
        )
        #: The op set every layer calls (:meth:`LlamaForCausalLM.use_ops`).
        self.ops = OpSetSlot()
        self.rotary = self.make_rotary(config)
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                dtype,
                sequence_parallel=sequence_parallel,
            )
            if self.is_first_stage
            else None
        )
        self.layers = nn.ModuleList(
            decoder_layer(config, self.layer_rotary(i), dtype, sequence_parallel, layer_idx=i)
            if self.start_layer <= i < self.end_layer
            else nn.Identity()  # a layer of another stage: holds nothing here
            for i in range(config.num_hidden_layers)
        )
        self.norm = (
            self.norm_class(config.hidden_size, config.rms_norm_eps, dtype, self.ops)
            if self.is_last_stage
            else None
        )
        #: The op set's whole-stack path over this stage's layers, for the
        #: steps it takes (:meth:`LlamaForCausalLM.use_ops`; None: layer by layer).
        self.step_path: StepPath | None = None

    def make_rotary(self, config: ModelArchConfig) -> RotaryEmbedding:
        """The rotary of ``rope_theta`` and ``rope_scaling`` (:attr:`rotary`)."""
        return RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            self.ops,
        )

    def layer_rotary(self, layer_idx: int) -> RotaryEmbedding:
        """Layer ``layer_idx``'s rotary (every layer's: :attr:`rotary`)."""
        return self.rotary

    def stage_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's decoder layers, in order."""
        return list(self.layers[self.start_layer : self.end_layer])  # type: ignore[arg-type]

    def begin(
        self, input_ids: torch.Tensor, intermediate_tensors: IntermediateTensors | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's input stream: (hidden, residual) embedded or received."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids), None
        assert intermediate_tensors is not None, "a later stage needs intermediate tensors"
        return intermediate_tensors["hidden_states"], intermediate_tensors["residual"]

    def finish(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | IntermediateTensors:
        """The stage's output: final norm (last stage) or intermediate tensors
        (``residual`` None: ``hidden`` is the whole stream)."""
        if self.norm is None:
            if residual is None:
                residual = torch.zeros_like(hidden)
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm.forward_residual(hidden, residual)
        return gather_tokens(hidden, self.sequence_parallel)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        hidden, residual = self.begin(input_ids, intermediate_tensors)
        path = self.step_path
        if path is not None and path.takes(hidden, meta):
            return self.finish(*path(hidden, residual, positions, meta))
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)
        # A received residual is left as it is; the ones the layers return
        # are the stream's own (each passed on to the next layer alone).
        for i, layer in enumerate(self.stage_layers()):
            hidden, residual = layer(cos_sin, hidden, residual, meta, own_residual=i > 0)
        return self.finish(hidden, residual)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM: ``forward`` to hidden states (or intermediate
    tensors), ``compute_logits`` on the rows to sample, ``load_weights`` from
    HF-named tensors. ``sequence_parallel`` is a no-op for a TP group of one.
    Another family built on these layers names its :attr:`decoder_layer`
    and maps its checkpoint's names (:meth:`param_target`,
    :meth:`checkpoint_names`)."""

    #: The decoder layer this family's model stacks.
    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer
    #: The model (a stage's embedding, layers and final norm).
    decoder_model: type[LlamaModel] = LlamaModel
    #: Whether :meth:`use_ops` asks the op set for its whole-stack step path
    #: (the CPU's decode stacks, Triton's fused decode: layers of the Llama
    #: family's shape, each op set declining the ones it does not run).
    takes_step_path: bool = True

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        *,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        config.validate()
        self.config = config
        self.tp_size = get_tp_group().world_size
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.model = self.decoder_model(config, dtype, self.sequence_parallel, self.decoder_layer)
        self.lm_head: ParallelLMHead | None = None
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, dtype, ops=self.model.ops
            )
        self.tie_weights()

    def use_ops(self, ops: OpSet) -> None:
        """Run every layer's norms, activations, rotary, attention and
        matmuls through ``ops`` (:func:`asyncstep.ops.select_ops`; the
        reference until then), and the steps its step path takes through
        that path (built here, once the weights are loaded and packed)."""
        windowed = any(w is not None for w in self.config.layer_windows)
        if windowed and not ops.attention_op.supports_sliding_window:
            raise UnsupportedModelError(
                f"sliding-window attention: the {ops.attention_op.name!r} attention op does not "
                "support it"
            )
        self.model.ops.ops = ops
        layers = self.model.stage_layers()
        self.model.step_path = ops.step_path(layers) if self.takes_step_path else None

    def tie_weights(self) -> None:
        """The LM head reads the input embedding's weight where the config
        ties them and this stage holds both (again after a weight is replaced)."""
        tied = self.config.tie_word_embeddings and self.model.embed_tokens is not None
        if tied and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tied_weight_names(self) -> set[str]:
        """State-dict names that alias another tensor (the tied LM head)."""
        if self.lm_head is not None and self.lm_head.weight is getattr(
            self.model.embed_tokens, "weight", None
        ):
            return {"lm_head.weight"}
        return set()

    @property
    def num_tokens_multiple(self) -> int:
        """A step's token count must be a multiple of this (the runner pads to it)."""
        return self.tp_size if self.sequence_parallel else 1

    def pp_all_gather_keys(self) -> dict[str, bool]:
        """For each intermediate tensor: may the pipeline channel send
        ``1 / tp_size`` of it per TP lane and all-gather it at the receiver?
        Yes for the replicated tensors of plain TP; no under sequence
        parallelism, where each lane's tensors are already its own token shard."""
        return {key: not self.sequence_parallel for key in ("hidden_states", "residual")}

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers, in order (the runner binds KV caches to them)."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if input_ids.shape[0] % self.num_tokens_multiple:
            raise ValueError(
                f"sequence parallelism: {input_ids.shape[0]} tokens is not a multiple of "
                f"tp_size ({self.tp_size}); pad the step"
            )
        return self.model(input_ids, positions, meta, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head.compute_logits(hidden_states)

    def expected_weight_names(self) -> set[str]:
        """Checkpoint (HF) names this rank needs: a fused parameter needs each part."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            names.update(self.checkpoint_names(name))
        if self.config.tie_word_embeddings and "lm_head.weight" in names:
            names.discard("lm_head.weight")
            names.add("model.embed_tokens.weight")
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, narrowing each to this rank's shard. Returns
        the checkpoint names consumed (compare with ``expected_weight_names``).
        Tensors of layers on other pipeline stages are skipped."""
        params = dict(self.named_parameters())
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for checkpoint_name, tensor in weights:
            name = checkpoint_name
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            if tied and name == "model.embed_tokens.weight" and name not in params:
                name = "lm_head.weight"  # a last stage without the embedding
            target, shard_id = self.param_target(name)
            if target not in params:
                if self._on_other_stage(target):
                    continue
                raise ModelLoadError(f"checkpoint weight {name!r} has no place in the model")
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if param.shape != tensor.shape:
                    raise ModelLoadError(
                        f"weight {name}: checkpoint shape {tuple(tensor.shape)} does not match "
                        f"the model's {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
            elif shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(checkpoint_name)
        return loaded

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint names loaded into parameter ``param_name``."""
        parts = [
            param_name.replace(ours, theirs)
            for ours, theirs, _ in STACKED_PARAMS
            if ours in param_name
        ]
        return parts or [param_name]

    def param_target(self, name: str) -> tuple[str, Any]:
        """Checkpoint tensor ``name``'s parameter and its shard id there (None: whole)."""
        return _fused_name(name)

    def _on_other_stage(self, name: str) -> bool:
        parts = name.split(".")
        if name.startswith("model.layers."):
            return not self.model.start_layer <= int(parts[2]) < self.model.end_layer
        return name.startswith(("model.embed_tokens", "model.norm", "lm_head"))


def _fused_name(name: str) -> tuple[str, str | int | None]:
    for ours, theirs, shard_id in STACKED_PARAMS:
        if theirs in name:
            return name.replace(theirs, ours), shard_id
    return name, None
