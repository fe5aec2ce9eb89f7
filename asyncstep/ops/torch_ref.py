"""The reference op set: torch's own ops, on any device and dtype; every
other op set is tested against it op by op.

``F.rms_norm`` is one fused kernel; in float32 it equals HF Llama's
``weight * (x * rsqrt(mean(x^2) + eps))`` bit for bit; in bf16/fp16 it
applies the weight before rounding (as vLLM's kernel does), not after. With
``float32_residual`` the residual stream stays in float32 and only the normed
output takes the activations' dtype: the stream's rounding no longer piles up
over the layers.

Its attention op is the one it is built with (the reference's,
:mod:`asyncstep.ops.torch_attention`, unless a kernel runs beside the
reference's layer ops); its linear runs a packed weight's own matmul where
it takes the step, else ``F.linear``; its experts are
:mod:`~asyncstep.ops.torch_moe`'s grouped matmul.

May import torch and :mod:`asyncstep.ops`' base, attention metadata, packed
formats, reference attention and reference experts.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from asyncstep.ops.attention import AttentionMetadata, AttentionShape
from asyncstep.ops.base import AttentionOp, RotaryCosSin, StepPath
from asyncstep.ops.packed import PackedWeight
from asyncstep.ops.torch_attention import TORCH_ATTENTION
from asyncstep.ops.torch_moe import fused_experts, select_experts

__all__ = ["TORCH_OPS", "TorchOps", "rotate"]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Neox-style ("rotate_half") rotation of ``x``'s heads."""
    shape = x.shape
    x = x.view(shape[0], -1, head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(shape)


class RmsNorm(Protocol):
    """An op set's :meth:`~TorchOps.rms_norm`."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, float32_residual: bool
    ) -> torch.Tensor: ...


def per_head_rms_norms(
    rms_norm: RmsNorm,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    float32_residual: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` over each head of q, then of k (``qk_rms_norm`` as two norms)."""
    heads = []
    for x, weight in ((q, q_weight), (k, k_weight)):
        x_heads = x.view(x.shape[0], -1, weight.shape[0])
        normed = rms_norm(x_heads, weight, eps, float32_residual=float32_residual)
        heads.append(normed.view(x.shape))
    return heads[0], heads[1]


class TorchOps:
    """The reference (see the module doc)."""

    name = "torch"

    def __init__(self, attention: AttentionOp = TORCH_ATTENTION) -> None:
        self._attention = attention

    @property
    def attention_op(self) -> AttentionOp:
        return self._attention

    @property
    def rotates_in_kv_store(self) -> bool:
        return self._attention.rotates

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        shape: AttentionShape,
        cos_sin_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        return self._attention(q, k, v, kv_cache, meta, shape, cos_sin_cache)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: PackedWeight | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if packed is None or not packed.applies(x):
            return F.linear(x, weight, bias)
        y = packed.mm(x)
        return y if bias is None else y + bias

    def logits(
        self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None
    ) -> torch.Tensor:
        if packed is not None and packed.applies(x):
            return packed.logits(x)
        return F.linear(x, weight)

    def fused_experts(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts sorted by expert, a matmul per expert's slice
        (:mod:`~asyncstep.ops.torch_moe`)."""
        return fused_experts(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)

    def select_experts(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        scoring_func: str = "softmax",
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's softmax / sigmoid and ``topk`` (:mod:`~asyncstep.ops.torch_moe`);
        the counts by ``index_add_``."""
        weights, ids = select_experts(
            router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func
        )
        if counts is not None:
            flat = ids.reshape(-1).long()
            counts.index_add_(0, flat, torch.ones_like(flat))
        return weights, ids

    def step_path(self, layers: list[Any]) -> StepPath | None:
        return None

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, float32_residual: bool
    ) -> torch.Tensor:
        if float32_residual:
            return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
        return F.rms_norm(x, weight.shape, weight, eps)

    def qk_rms_norm(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        *,
        float32_residual: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rms_norm` of q's heads, then of k's (the op set's own)."""
        return per_head_rms_norms(self.rms_norm, q, k, q_weight, k_weight, eps, float32_residual)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        *,
        float32_residual: bool,
        own_residual: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if float32_residual:
            residual = x.float() if residual is None else residual + x
            return F.rms_norm(residual, weight.shape, weight, eps).to(x.dtype), residual
        residual = x if residual is None else residual + x
        return F.rms_norm(residual, weight.shape, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_cos_sin(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RotaryCosSin:
        cos_sin = cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return RotaryCosSin(positions, cos, sin)

    def rotary(
        self,
        cos_sin: RotaryCosSin,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin.cos, cos_sin.sin
        assert cos is not None and sin is not None, "a rotation of this op set's rotary_cos_sin"
        return rotate(q, cos, sin, head_dim), rotate(k, cos, sin, head_dim)


#: The reference, shared (it holds nothing).
TORCH_OPS = TorchOps()
