"""gpt-oss (``GptOssForCausalLM``) on the Llama family's attention and
decoder machinery (:mod:`asyncstep.models.llama`) and the MoE families'
model (:mod:`asyncstep.models.moe`), as transformers' ``modeling_gpt_oss``:

* attention: q/k/v and o biases (``attention_bias``), a learned sink logit
  per head joining each query's softmax denominator
  (:attr:`~asyncstep.ops.attention.AttentionShape.sinks`), layers sliding
  (``sliding_window``) or full as ``layer_types`` says, YaRN rope
  (:mod:`asyncstep.models.layers.rotary`);
* every layer a MoE layer: the router a linear with bias whose top-k logits
  are softmaxed; the experts with biases and the "swigluoai" activation.

Checkpoint names are transformers': ``mlp.router.{weight,bias}`` load into
the block's ``gate``; ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (gate and
up interleaved) and ``gate_up_proj_bias``, ``down_proj`` ``[E, I, H]`` and
``down_proj_bias`` into the experts' ``w13`` / ``w2`` parameters (gate rows
then up rows, converted once at load); ``self_attn.sinks`` whole, narrowed to
this rank's heads. Tensor and pipeline parallelism are the Llama family's
(experts split along their intermediate dimension). MXFP4 experts
(``gate_up_proj_blocks`` / ``_scales``, ``down_proj_blocks`` / ``_scales``:
the released checkpoints; each projection's blocks and scales kept until
both have come) are kept packed where the CPU library computes on them: a
float32 model on the CPU whose library builds
(:func:`~asyncstep.ops.select.cpu_mxfp4_experts_available`),
this rank's slice whole blocks of 32, no expert parallelism
(:meth:`GptOssForCausalLM.keeps_mxfp4`; repacked once,
:meth:`~asyncstep.models.layers.moe.FusedMoE.load_mxfp4`: 4.25 bits a
value); an op set other than the CPU's dequantizes them at its first
forward. Otherwise they are dequantized at load to the model's dtype
(:func:`~asyncstep.models.mxfp4.dequantize_mxfp4`) and loaded as the
unquantized tensors.

An op set must honour attention sinks (:attr:`AttentionOp.supports_sinks`:
every built-in attention op does) and sliding windows; in float32 on the
CPU its steps without sliding windows take the CPU's float32 stack
(:mod:`asyncstep.ops.cpu.f32_stack`), else it runs layer by layer.

May import torch, :mod:`asyncstep.channels`, the model config, layers and
the Llama and MoE models.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from asyncstep.channels import get_tp_group
from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.layers.linear import _make_param
from asyncstep.models.layers.moe import FusedMoE
from asyncstep.models.layers.rotary import RotaryEmbedding
from asyncstep.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from asyncstep.models.moe import MoeForCausalLM, MoeMLP
from asyncstep.models.mxfp4 import dequantize_mxfp4
from asyncstep.ops.base import OpSet
from asyncstep.ops.mxfp4 import Mxfp4Weight
from asyncstep.ops.select import cpu_mxfp4_experts_available

__all__ = ["GptOssAttention", "GptOssDecoderLayer", "GptOssForCausalLM", "keeps_mxfp4_experts"]

#: A checkpoint's expert tensor -> (our parameter, the loader's shard kind).
_EXPERT_TENSORS: dict[str, tuple[str, str]] = {
    "gate_up_proj": ("w13_weight", "w13_interleaved"),
    "gate_up_proj_bias": ("w13_bias", "w13_bias_interleaved"),
    "down_proj": ("w2_weight", "w2"),
    "down_proj_bias": ("w2_bias", "w2_bias"),
}
_CHECKPOINT_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.(\w+)")
_MXFP4_PART = re.compile(r"((.*)\.experts\.(gate_up_proj|down_proj))_(blocks|scales)")
_PARAM_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp)\.experts\.(w13_weight|w13_bias|w2_weight|w2_bias)"
)


class GptOssAttention(LlamaAttention):
    """Llama's attention with an output bias and per-head sinks (this
    rank's heads)."""

    o_proj_bias = True

    def __init__(
        self,
        config: ModelArchConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        sequence_parallel: bool = False,
        layer_idx: int = 0,
    ):
        super().__init__(config, rotary, dtype, sequence_parallel, layer_idx)
        num_heads = self.qkv_proj.num_heads
        # Float32 whatever the model's dtype: every attention op reads them so
        # (a checkpoint's bfloat16 sinks are exact in it), once, not per step.
        self.sinks = _make_param((num_heads,), torch.float32, self._load_sinks)
        self.attn.shape = dataclasses.replace(self.attn.shape, sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Every head's sink, narrowed to this rank's heads."""
        tp = get_tp_group()
        n = param.shape[0]
        if tuple(loaded.shape) != (n * tp.world_size,):
            raise ModelLoadError(
                f"attention sinks: checkpoint shape {tuple(loaded.shape)} does not match the "
                f"model's ({n * tp.world_size},)"
            )
        param.data.copy_(loaded.narrow(0, tp.rank_in_group * n, n))


class GptOssMLP(MoeMLP):
    """gpt-oss's feed-forward: a sparse MoE block whose router and experts
    carry biases (its top-k weights never renormalised: the config's
    ``norm_topk_prob`` is False, the softmax of the top-k logits sums to
    one)."""

    biased = True


class GptOssDecoderLayer(LlamaDecoderLayer):
    """A gpt-oss layer: :class:`GptOssAttention`, then :class:`GptOssMLP`
    (every layer)."""

    attention_class: type[LlamaAttention] = GptOssAttention
    mlp_class: type[nn.Module] = GptOssMLP


class GptOssForCausalLM(MoeForCausalLM):
    """gpt-oss's causal LM (the module's docstring)."""

    decoder_layer = GptOssDecoderLayer
    #: Whether MXFP4 experts may stay packed (:meth:`keeps_mxfp4`); False:
    #: always dequantized at load (the dense baseline of a measurement).
    mxfp4_packed = True

    def use_ops(self, ops: OpSet) -> None:
        """Layer by layer through ``ops``, whose attention must honour
        sinks and sliding windows."""
        attention = ops.attention_op
        if not getattr(attention, "supports_sinks", False):
            raise UnsupportedModelError(
                f"gpt-oss's attention sinks: the {attention.name!r} attention op does not "
                "support them (every built-in op set does)"
            )
        windowed = any(w is not None for w in self.config.layer_windows)
        if windowed and not attention.supports_sliding_window:
            raise UnsupportedModelError(
                f"sliding-window attention: the {attention.name!r} attention op does not support it"
            )
        super().use_ops(ops)

    def param_target(self, name: str) -> tuple[str, Any]:
        """The router's and the experts' tensors (the module's docstring);
        others as the Llama family's."""
        if ".mlp.router." in name:
            return name.replace(".mlp.router.", ".mlp.gate."), None
        match = _CHECKPOINT_EXPERT.fullmatch(name)
        if match is not None and match[2] in _EXPERT_TENSORS:
            param, kind = _EXPERT_TENSORS[match[2]]
            return f"{match[1]}.experts.{param}", kind
        return LlamaForCausalLM.param_target(self, name)

    def checkpoint_names(self, param_name: str) -> list[str]:
        if ".mlp.gate." in param_name:
            return [param_name.replace(".mlp.gate.", ".mlp.router.")]
        match = _PARAM_EXPERT.fullmatch(param_name)
        if match is not None:
            theirs = next(k for k, (p, _) in _EXPERT_TENSORS.items() if p == match[2])
            name = f"{match[1]}.experts.{theirs}"
            if self.config.experts_mxfp4 and not theirs.endswith("bias"):
                return [f"{name}_blocks", f"{name}_scales"]
            return [name]
        return LlamaForCausalLM.checkpoint_names(self, param_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the Llama family's, MXFP4 experts dequantized first (the
        module's docstring); the names consumed include both parts."""
        consumed: set[str] = set()
        loaded = super().load_weights(self._dequantized(weights, consumed))
        made = {name.rsplit("_", 1)[0] for name in consumed}  # the dequantized tensors
        return (loaded - made) | consumed

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype = torch.float32,
        *,
        sequence_parallel: bool = False,
    ):
        super().__init__(config, dtype, sequence_parallel=sequence_parallel)
        for module in self.modules():  # experts to be kept packed: no dense room
            if isinstance(module, FusedMoE) and self.keeps_mxfp4(module):
                module.w13_weight.data = torch.empty(0, dtype=dtype)
                module.w2_weight.data = torch.empty(0, dtype=dtype)

    def keeps_mxfp4(self, experts: FusedMoE) -> bool:
        """Whether ``experts``' MXFP4 projections stay packed (then their
        dense parameters are empty from the build on): MXFP4 experts of a
        float32 model on the CPU with the library, their slice whole
        blocks, no expert parallelism (:attr:`mxfp4_packed` on;
        :func:`keeps_mxfp4_experts` from the config)."""
        weight = experts.w13_weight
        return (
            self.config.experts_mxfp4
            and self.mxfp4_packed
            and weight.dtype == torch.float32
            and weight.device.type == "cpu"
            and experts.takes_mxfp4()
            and cpu_mxfp4_experts_available()
        )

    def _experts(self, prefix: str) -> FusedMoE | None:
        """The experts module at ``prefix`` (``model.layers.{i}.mlp``), if
        this stage holds it."""
        try:
            module = self.get_submodule(f"{prefix}.experts")
        except AttributeError:
            return None
        return module if isinstance(module, FusedMoE) else None

    def _dequantized(
        self, weights: Iterable[tuple[str, torch.Tensor]], consumed: set[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with each MXFP4 projection's blocks and scales kept
        packed in its experts (:meth:`keeps_mxfp4`) or as the unquantized
        tensor (transformers' ``[E, H, 2I]`` / ``[E, I, H]``)."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        dtype = next(self.parameters()).dtype
        for name, tensor in weights:
            match = _MXFP4_PART.fullmatch(name)
            if match is None or not self.config.experts_mxfp4:
                yield name, tensor
                continue
            parts = pending.setdefault(match[1], {})
            parts[match[4]] = tensor
            if len(parts) < 2:
                continue
            del pending[match[1]]
            consumed.update((f"{match[1]}_blocks", f"{match[1]}_scales"))
            experts = self._experts(match[2])
            try:
                if experts is not None and self.keeps_mxfp4(experts):
                    packed = Mxfp4Weight.from_checkpoint(parts["blocks"], parts["scales"])
                    experts.load_mxfp4("w13" if match[3] == "gate_up_proj" else "w2", packed)
                    continue
                dense = dequantize_mxfp4(parts["blocks"], parts["scales"], dtype)
            except ValueError as exc:
                raise ModelLoadError(f"{match[1]}: {exc}") from None
            yield match[1], dense.transpose(1, 2)
        if pending:
            raise ModelLoadError(
                f"MXFP4 experts: {sorted(pending)[0]} lacks its blocks or its scales"
            )


def keeps_mxfp4_experts(
    arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, tp_size: int, ep_size: int
) -> bool:
    """Whether a rank of ``arch`` will hold its experts MXFP4
    (:meth:`GptOssForCausalLM.keeps_mxfp4`, told before the model is built:
    the memory estimate's)."""
    inter = arch.moe_intermediate_size // tp_size
    return (
        arch.family == "gpt_oss"
        and arch.experts_mxfp4
        and GptOssForCausalLM.mxfp4_packed
        and dtype == torch.float32
        and device.type == "cpu"
        and ep_size == 1
        and arch.hidden_size % 32 == 0
        and inter % 32 == 0
        and inter * tp_size == arch.moe_intermediate_size
        and cpu_mxfp4_experts_available()
    )
