"""RMSNorm, optionally after the residual add: the weight, and the call of
the model's op set (:class:`~asyncstep.ops.OpSet`: the reference's
semantics, ``float32_residual`` included, in :mod:`asyncstep.ops.torch_ref`).

With ``float32_residual`` (bf16/fp16 models on the CPU, set by the loader)
the norm's weight and the residual stream stay in float32 and only the
normed output takes the activations' dtype. :class:`GemmaRMSNorm` holds
``1 + w`` for a checkpoint's ``w`` (Gemma's weights are offsets from 1)."""

from __future__ import annotations

import torch
from torch import nn

from asyncstep.errors import ModelLoadError
from asyncstep.ops.slot import OpSetSlot


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ):
        """``ops``: the model's op-set slot (a slot of its own holding the
        reference when None)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.ops = ops or OpSetSlot()
        #: Weight and residual in float32, output in the input's dtype (set by the loader).
        self.float32_residual = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.ops.rms_norm(
            x, self.weight, self.eps, float32_residual=self.float32_residual
        )

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, *, own_residual: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (or start it), then normalise: returns (normed,
        residual). ``residual`` itself is left as it is, unless
        ``own_residual`` says it is the caller's to give up (a residual an
        earlier call returned, read by no one else): the op set may then add
        into it in place and return it."""
        return self.ops.ops.add_rms_norm(
            x,
            residual,
            self.weight,
            self.eps,
            float32_residual=self.float32_residual,
            own_residual=own_residual,
        )


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, ``x * rsqrt(mean(x^2) + eps) * (1 + w)``: checkpoints
    store the offset ``w``; the parameter holds ``1 + w``, added in float32
    as the checkpoint's tensor loads (its ``weight_loader``), so the op set's
    ``rms_norm`` / ``add_rms_norm`` (and their fused kernels) run it as any
    RMSNorm. A Gemma model's state dict (the packed cache) thus holds ``1 + w``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ):
        super().__init__(hidden_size, eps, dtype, ops)
        self.weight.weight_loader = load_offset_weight  # type: ignore[attr-defined]


def load_offset_weight(param: nn.Parameter, offset: torch.Tensor) -> None:
    """``param = 1 + offset``, the sum in float32 (as Gemma computes it)."""
    if param.shape != offset.shape:
        raise ModelLoadError(
            f"norm weight: checkpoint shape {tuple(offset.shape)} does not match the model's "
            f"{tuple(param.shape)}"
        )
    param.data.copy_(offset.float() + 1.0)
