"""RMSNorm, optionally after the residual add.

``torch.nn.functional.rms_norm`` is one fused kernel; in float32 it equals HF
Llama's ``weight * (x * rsqrt(mean(x^2) + eps))`` bit for bit; in bf16/fp16 it
applies the weight before rounding (as vLLM's kernel does), not after.

With ``float32_residual`` (bf16/fp16 models on the CPU) the norm's weight
and the residual stream stay in float32 and only the normed output takes the
activations' dtype: the stream's rounding no longer piles up over the layers
(a bf16 residual of magnitude ~2.5e4 keeps steps of 128), and on the CPU
the adds cost little beside the matmuls."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        #: Add and normalise in one Triton kernel (set by the runner on CUDA).
        self.use_triton = False
        #: Weight and residual in float32, output in the input's dtype (set by the loader).
        self.float32_residual = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_residual:
            return self._norm(x.float()).to(x.dtype)
        return self._norm(x)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (or start it), then normalise: returns (normed, residual)."""
        if self.use_triton and residual is not None:
            from asyncstep.gpu.triton_fused import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if self.float32_residual:
            residual = x.float() if residual is None else residual + x
            return self._norm(residual).to(x.dtype), residual
        residual = x if residual is None else residual + x
        return self._norm(residual), residual
