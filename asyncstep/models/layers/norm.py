"""RMSNorm, optionally after the residual add: the weight, and the call of
the model's op set (:class:`~asyncstep.ops.OpSet`: the reference's
semantics, ``float32_residual`` included, in :mod:`asyncstep.ops.torch_ref`).

With ``float32_residual`` (bf16/fp16 models on the CPU, set by the loader)
the norm's weight and the residual stream stay in float32 and only the
normed output takes the activations' dtype."""

from __future__ import annotations

import torch
from torch import nn

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
