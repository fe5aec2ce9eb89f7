"""The CPU library's op set: the residual add + RMSNorm over a float32
residual stream, RMSNorm, and ``silu(gate) * up`` in one call each of
``cpu_kernels.c`` (:class:`~asyncstep.ops.cpu.layer_ops.CpuLayerOps`: torch's
float32 arithmetic, bit for bit on x86); the LM head of a bfloat16 model in
float32 sums (``cpu_dense.c``: a bfloat16 logit of ~20 moves in steps of
0.125, which ties tokens that float32 separates); every dense bfloat16
projection through the same matmul (one K order for every row count: a
request's outputs do not depend on its batch, issue 40) unless
``invariant_dense`` is off (torch's ``F.linear``); every dense float32
projection and the float32 LM head through the library's float32 matmul
(``cpu_dense_f32.c``, the same promise) unless ``invariant_float32`` is off
(torch's ``F.linear``); the reference's ops where
the library does not take the input (float16, a residual stream that is not
float32), and for the rotary embedding (the CPU attention op rotates q and
k as it reads them); a mixture-of-experts layer's float32 and bfloat16
experts are the library's grouped experts in one call (``cpu_moe.c``,
float32 sums: batch-invariant), its other experts the reference's grouped
matmul (:mod:`~asyncstep.ops.torch_moe`) over this op set's linear. Its
router is the library's (``cpu_moe_router.c``). Its step
path: the whole decoder stack in one call
(:mod:`~asyncstep.ops.cpu.decode_stack` for quantized projections,
:mod:`~asyncstep.ops.cpu.f32_stack` for dense float32 ones and float32
mixtures of experts).

May import torch and :mod:`asyncstep.ops`' base, references (layer ops, experts) and CPU library.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncstep.ops.base import AttentionOp, StepPath
from asyncstep.ops.cpu.decode_stack import CpuDecodeStack
from asyncstep.ops.cpu.dense import dense_matmul
from asyncstep.ops.cpu.dense_f32 import dense_f32_matmul, takes_float32
from asyncstep.ops.cpu.f32_stack import CpuF32Stack
from asyncstep.ops.cpu.layer_ops import CpuLayerOps
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.moe import moe_experts, moe_router
from asyncstep.ops.cpu.quant import CpuQuantWeight
from asyncstep.ops.mxfp4 import Mxfp4Weight
from asyncstep.ops.packed import PackedWeight
from asyncstep.ops.torch_attention import TORCH_ATTENTION
from asyncstep.ops.torch_moe import fused_experts
from asyncstep.ops.torch_ref import TorchOps

__all__ = ["CpuHeadOps", "CpuOps"]


class CpuHeadOps(TorchOps):
    """The reference's layer ops with the CPU's LM head: float32 logits from
    the library's packed head or its dense bfloat16 matmul. Its float32
    logits are the CPU's precision, not a fused kernel: ``fused_kernels``
    off on the CPU runs this (a bfloat16-rounded head ties top tokens)."""

    name = "cpu-head"

    def logits(
        self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None
    ) -> torch.Tensor:
        """float32: the library's packed head, or its dense bfloat16 matmul."""
        if isinstance(packed, CpuQuantWeight) and packed.applies(x):
            return packed.logits(x)
        if weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            matmul = dense_matmul()
            if matmul is not None:
                return matmul(x, weight)
        return super().logits(x, weight, packed)


class CpuOps(CpuHeadOps):
    """The CPU library's layer ops, with the reference's where they do not apply."""

    name = "cpu"
    #: The experts may stay MXFP4 (:class:`~asyncstep.ops.mxfp4.Mxfp4Weight`).
    takes_mxfp4_experts = True

    def __init__(
        self,
        layer_ops: CpuLayerOps,
        attention: AttentionOp = TORCH_ATTENTION,
        *,
        invariant_dense: bool = True,
        invariant_float32: bool = True,
    ) -> None:
        super().__init__(attention)
        self.layer_ops = layer_ops
        #: Dense bfloat16 projections through the library's matmul (one K
        #: order for every row count); False: torch's ``F.linear``.
        self.invariant_dense = invariant_dense
        #: Dense float32 projections and the float32 LM head through the
        #: library's float32 matmul (``cpu_dense_f32.c``: one K order for
        #: every row count); False: torch's ``F.linear``.
        self.invariant_float32 = invariant_float32

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: PackedWeight | None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The packed weight's matmul where it applies; a dense bfloat16
        weight through the library's matmul (one K order for every row
        count: a row's outputs do not depend on the others, issue 40) in
        ``x``'s dtype, a dense float32 one through its float32 matmul (the
        bias added to its sums); else the reference's ``F.linear``."""
        if packed is not None and packed.applies(x):
            return super().linear(x, weight, packed, bias)
        if self.invariant_float32 and x.dtype == weight.dtype == torch.float32:
            y = self._float32(x, weight)
            if y is not None:
                return y if bias is None else y + bias
        matmul = dense_matmul() if self.invariant_dense and _dense_bfloat16(x, weight) else None
        if matmul is None:
            return super().linear(x, weight, packed, bias)
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if bias is None:
            y = matmul(rows, weight, x.dtype)
        else:  # the bias added to the float32 sums, then rounded once
            y = (matmul(rows, weight) + bias.float()).to(x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    def logits(
        self, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight | None
    ) -> torch.Tensor:
        """As :class:`CpuHeadOps`; a float32 head through the library's
        float32 matmul where ``invariant_float32`` is on."""
        if not (packed is not None and packed.applies(x)) and self.invariant_float32:
            y = self._float32(x, weight)
            if y is not None:
                return y
        return super().logits(x, weight, packed)

    def _float32(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """``x @ weight.T`` by the library's float32 matmul (x of any
        leading shape); None where it does not take them."""
        matmul = dense_f32_matmul()
        if matmul is None or x.numel() == 0 or x.dim() < 1:
            return None
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1 or rows.stride(0) < rows.shape[1]:
            rows = rows.contiguous()
        if not takes_float32(rows, weight):
            return None
        return matmul(rows, weight).view(*x.shape[:-1], weight.shape[0])

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
        """float32 or bfloat16 experts (float32, bfloat16 or MXFP4 weights;
        bfloat16 ones: float32 sums, rounded once): the library's grouped
        experts in one call (:mod:`~asyncstep.ops.cpu.moe`) where they
        apply; else the reference's grouped matmul
        (:mod:`~asyncstep.ops.torch_moe`) through :meth:`linear` (MXFP4
        weights dequantized for the call): a dense bfloat16 expert takes the
        library's matmul where ``invariant_dense`` is on. A token's output
        then does not depend on the rows its experts get from other tokens
        (float32 always; bfloat16 where ``invariant_dense`` is on)."""
        experts = moe_experts()
        if experts is not None and experts.applies(hidden, w13, w2, topk_ids, activation):
            return experts(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
        if isinstance(w13, Mxfp4Weight):
            w13 = w13.dequantize().to(hidden.dtype)
        if isinstance(w2, Mxfp4Weight):
            w2 = w2.dequantize().to(hidden.dtype)
        return fused_experts(
            hidden,
            w13,
            w2,
            topk_weights,
            topk_ids,
            activation,
            w13_bias,
            w2_bias,
            matmul=lambda x, weight: self.linear(x, weight, None),
        )

    def select_experts(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        scoring_func: str = "softmax",
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The library's router (:class:`~asyncstep.ops.cpu.moe.CpuMoeRouter`:
        the float32 stack's, so the two paths route alike) where it applies,
        else the reference's."""
        router = moe_router()
        if router is None or not router.applies(router_logits, top_k, scoring_func):
            return super().select_experts(
                router_logits,
                top_k,
                renormalize=renormalize,
                scoring_func=scoring_func,
                counts=counts,
            )
        return router(
            router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func, counts=counts
        )

    def step_path(self, layers: list[Any]) -> StepPath | None:
        """The library's decoder stack in one call, where the layers qualify:
        quantized projections (:mod:`~asyncstep.ops.cpu.decode_stack`), else
        dense float32 ones, mixtures of experts too (:mod:`~asyncstep.ops.cpu.f32_stack`)."""
        kernels = load_cpu_kernels()
        if kernels is None:
            return None
        return CpuDecodeStack.build(kernels, layers) or CpuF32Stack.build(kernels, layers)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, float32_residual: bool
    ) -> torch.Tensor:
        if _float32_stream(x, float32_residual) and self.layer_ops.takes_vectors(x):
            return self.layer_ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps, float32_residual=float32_residual)

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
        if _float32_stream(x, float32_residual) and self._takes(x, residual):
            in_place = own_residual and residual is not None
            return self.layer_ops.add_rms_norm(x, residual, weight, eps, in_place=in_place)
        return super().add_rms_norm(
            x, residual, weight, eps, float32_residual=float32_residual, own_residual=own_residual
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.layer_ops.takes(gate_up):
            return self.layer_ops.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

    def _takes(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether the library takes x and a float32 residual stream."""
        if not self.layer_ops.takes(x):
            return False
        return residual is None or (
            residual.dtype == torch.float32 and self.layer_ops.takes(residual)
        )


def _float32_stream(x: torch.Tensor, float32_residual: bool) -> bool:
    """Whether a norm's input is a float32 residual stream: kept float32
    beside 16-bit activations, or a float32 model's own (the library's
    norms are torch's float32 arithmetic: the same bits, one call)."""
    return float32_residual or x.dtype == torch.float32


def _dense_bfloat16(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the library's dense matmul takes ``x @ weight.T``: a bfloat16
    weight with unit stride along K, float32 or bfloat16 ``x``, on the CPU."""
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.shape[-1] == weight.shape[1]
        and x.numel() > 0
    )
