"""The op-set protocol: a decoder layer's ops as one object.

An :class:`OpSet` computes RMSNorm, the residual add + RMSNorm, the gated
MLP's ``silu(gate) * up``, the rotary embedding of q and k, the paged
attention with its KV store (an :class:`AttentionOp`, which may rotate q and
k itself as it reads them: :attr:`OpSet.rotates_in_kv_store`), a
mixture-of-experts layer's experts (:meth:`OpSet.fused_experts`) and the linear
layers' matmuls for each weight format (a packed format carries its own
matmul, :class:`~asyncstep.ops.packed.PackedWeight`; the op set runs the
dense weights); every implementation gives
:class:`~asyncstep.ops.torch_ref.TorchOps`' results (bit for bit, or within
the rounding its module states).

An op set that computes on MXFP4 experts kept packed (the CPU's) is also a
:class:`TakesMxfp4Experts`: its ``fused_experts`` takes
:class:`~asyncstep.ops.mxfp4.Mxfp4Weight` projections too.

May import torch, :mod:`asyncstep.ops.attention`, :mod:`asyncstep.ops.packed`
and :mod:`asyncstep.ops.mxfp4`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from asyncstep.ops.attention import AttentionMetadata, AttentionShape
from asyncstep.ops.mxfp4 import Mxfp4Weight
from asyncstep.ops.packed import PackedWeight

__all__ = ["AttentionOp", "OpSet", "RotaryCosSin", "StepPath"]


@dataclass
class RotaryCosSin:
    """A step's rotation: each token's position and, where the op set
    rotates with torch, the cos and sin of its angles ([tokens, 1,
    head_dim / 2] each; a fused kernel reads them from the cache by position)."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class AttentionOp(Protocol):
    """A layer's paged attention: stores the step's keys and values at their
    slots (``meta.slot_mapping``), then attends every query row over its
    request's cached keys. q ``[tokens, heads * head_dim]``, k and v
    ``[tokens, kv_heads * head_dim]`` (column slices of the QKV projection's
    output may come); rows past ``meta.num_actual_tokens`` are padding: not
    stored, and zeros in the output ``[tokens, heads * head_dim]``. Where
    :attr:`rotates`, q and k are rotated with ``cos_sin_cache`` (None: a
    layer without a rotary, whose q and k are never rotated)."""

    #: The name the logs show.
    name: str
    #: Whether q and k come in unrotated and the op rotates them as it reads
    #: them (from ``cos_sin_cache`` at ``meta.positions``).
    rotates: bool
    #: Whether the op reads the reference's host-made plan of the decodes
    #: (``meta.decode_buckets``; then no FULL CUDA graph runs over it).
    plans_decodes: bool
    #: Whether the op honours :attr:`AttentionShape.sliding_window` (a model
    #: with a windowed layer refuses an op set whose attention does not).
    supports_sliding_window: bool
    #: Whether the op honours :attr:`AttentionShape.sinks` (a model with
    #: attention sinks refuses an op set whose attention does not).
    supports_sinks: bool
    #: Whether the op applies :attr:`AttentionShape.qk_norm` to q and k
    #: itself (then they come to it un-normed); else they come normed.
    norms_qk: bool

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        shape: AttentionShape,
        cos_sin_cache: torch.Tensor | None,
    ) -> torch.Tensor: ...


class StepPath(Protocol):
    """A pipeline stage's decoder layers as one fast path (a whole-stack
    kernel or a fused decode), for the steps it takes; other steps run the
    layers one by one."""

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step of ``hidden`` rows goes through the path."""
        ...

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden, residual)`` after the stage's layers, for the final
        norm (None: ``hidden`` is the whole residual stream)."""
        ...


class OpSet(Protocol):
    """A decoder layer's non-matmul ops. ``float32_residual``: the norm's
    weight and the residual stream are float32 and only the normed output
    takes x's dtype (bf16/fp16 models on the CPU)."""

    #: The name the logs and the step timelines show.
    name: str

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, float32_residual: bool
    ) -> torch.Tensor:
        """RMSNorm of ``x`` over its last dimension."""
        ...

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
        """Per-head q/k norms (Qwen3, Gemma 3): each head of ``q [T, Hq *
        D]`` and ``k [T, Hk * D]`` (rows may be column slices of a qkv
        output) through :meth:`rms_norm` over its D features, with
        ``q_weight`` / ``k_weight`` ``[D]``; ``(q, k)`` of the shapes given."""
        ...

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
        """``residual += x`` (or start it at x), then RMSNorm: (normed,
        residual). ``residual`` is left as it is unless ``own_residual``
        says the caller gives it up (an op set may then add into it)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up = [gate | up]`` rows."""
        ...

    def rotary_cos_sin(
        self, cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> RotaryCosSin:
        """The step's rotation, looked up once and shared by every layer.
        ``cos_sin_cache``: float32 ``[max_position, head_dim]``, cos in its
        first half, sin in its second."""
        ...

    def rotary(
        self,
        cos_sin: RotaryCosSin,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style rotary embedding of q ``[tokens, heads * head_dim]``
        and k ``[tokens, kv_heads * head_dim]`` (an op set may rotate them
        in place and return them)."""
        ...

    @property
    def attention_op(self) -> AttentionOp:
        """The paged attention this op set runs."""
        ...

    @property
    def rotates_in_kv_store(self) -> bool:
        """Whether :meth:`attention` rotates q and k (then they come to it
        unrotated, and :meth:`rotary` is not called)."""
        ...

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
        """The rotary (where :attr:`rotates_in_kv_store`), the KV store and
        the paged attention of one layer (:class:`AttentionOp`)."""
        ...

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: PackedWeight | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias)``: through the packed copy of ``weight``
        (its format's own matmul) where it takes a step of ``x``'s size,
        else the op set's matmul of the dense weight."""
        ...

    def logits(
        self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None
    ) -> torch.Tensor:
        """The LM head's ``x @ weight.T``: as :meth:`linear`, in a dtype of
        the op set's choosing (float32 where its matmul sums so)."""
        ...

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
        """A mixture-of-experts layer's experts (vLLM's ``fused_experts``):
        ``hidden`` ``[T, H]``; ``w13`` ``[E_local, 2 * I_local, H]`` (each
        expert's gate rows, then its up rows); ``w2`` ``[E_local, H,
        I_local]``; the router's ``topk_weights`` ``[T, k]`` float32 and
        ``topk_ids`` ``[T, k]`` int32. Returns ``[T, H]`` in ``hidden``'s
        dtype: each token's experts' ``w2 @ (act(gate) * up)`` weighted and
        summed (a partial sum where ``I_local`` is a TP slice). ``activation``
        "silu": ``silu(gate) * up``; "swigluoai" (gpt-oss): the clamped
        ``(up + 1) * gate * sigmoid(1.702 * gate)``. Optional biases
        ``w13_bias`` ``[E_local, 2 * I_local]`` (added to ``gate_up``) and
        ``w2_bias`` ``[E_local, H]`` (added to the expert's output before the
        routing weight multiplies it)
        (:func:`asyncstep.ops.torch_moe.fused_experts`, the reference)."""
        ...

    def select_experts(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        scoring_func: str = "softmax",
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture-of-experts layer's router: each token's ``(topk_weights
        [T, k] float32, topk_ids [T, k] int32)`` from ``router_logits [T, E]``
        (:func:`asyncstep.ops.torch_moe.select_experts`, the reference:
        scorings "softmax", "sigmoid", "topk_softmax"); ValueError for another.
        ``counts`` (the layer's load counter, int64 ``[E]`` on the device),
        where given: each token's k experts added to it, on the device."""
        ...

    def step_path(self, layers: list[Any]) -> StepPath | None:
        """The op set's whole-stack path over a stage's decoder ``layers``
        (their weights loaded and packed), where they qualify; else None.
        The layers are a model's, read by their attributes (ops import no
        model)."""
        ...


@runtime_checkable
class TakesMxfp4Experts(Protocol):
    """An op set whose experts may stay MXFP4 (``isinstance`` tells:
    it has :attr:`takes_mxfp4_experts`)."""

    #: True: ``fused_experts`` takes :class:`~asyncstep.ops.mxfp4.Mxfp4Weight` projections.
    takes_mxfp4_experts: bool

    def fused_experts(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor | Mxfp4Weight,
        w2: torch.Tensor | Mxfp4Weight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`OpSet.fused_experts`, either projection MXFP4 too."""
        ...
