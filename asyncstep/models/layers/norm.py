"""RMSNorm, optionally after the residual add.

``torch.nn.functional.rms_norm`` is one fused kernel; in float32 it equals HF
Llama's ``weight * (x * rsqrt(mean(x^2) + eps))`` bit for bit; in bf16/fp16 it
applies the weight before rounding (as vLLM's kernel does), not after.

With ``float32_residual`` (bf16/fp16 models on the CPU) the norm's weight
and the residual stream stay in float32 and only the normed output takes the
activations' dtype: the stream's rounding no longer piles up over the layers
(a bf16 residual of magnitude ~2.5e4 keeps steps of 128), and on the CPU
the adds cost little beside the matmuls. There, with ``use_cpu_kernel``, the
add, the norm and the conversions are one call of the CPU library
(:mod:`~asyncstep.models.layers.cpu_layer_ops`: torch's float32 arithmetic,
bit for bit on x86); torch's ops run where the library is not loaded or
does not take the input (float16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncstep.models.layers.cpu_kernels import load_cpu_kernels
from asyncstep.models.layers.cpu_layer_ops import CpuLayerOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        #: Add and normalise in one Triton kernel (set by the runner on CUDA).
        self.use_triton = False
        #: Weight and residual in float32, output in the input's dtype (set by the loader).
        self.float32_residual = False
        #: With ``float32_residual``: add and normalise in one call of the CPU
        #: library where it is loaded (set by the runner on the CPU).
        self.use_cpu_kernel = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def _cpu_ops(self) -> CpuLayerOps | None:
        """The CPU library's layer ops, when this norm is to use them and they load."""
        if not (self.use_cpu_kernel and self.float32_residual):
            return None
        kernels = load_cpu_kernels()
        return None if kernels is None else kernels.layer_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_residual:
            ops = self._cpu_ops()
            if ops is not None and ops.takes_vectors(x):
                return ops.rms_norm(x, self.weight, self.eps)
            return self._norm(x.float()).to(x.dtype)
        return self._norm(x)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None, *, own_residual: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (or start it), then normalise: returns (normed,
        residual). ``residual`` itself is left as it is, unless
        ``own_residual`` says it is the caller's to give up (a residual an
        earlier call returned, read by no one else): the CPU kernel then adds
        into it in place and returns it."""
        if self.use_triton and residual is not None:
            from asyncstep.gpu.triton_fused import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if self.float32_residual:
            ops = self._cpu_ops()
            if ops is not None and _kernel_takes(ops, x, residual):
                in_place = own_residual and residual is not None
                return ops.add_rms_norm(x, residual, self.weight, self.eps, in_place=in_place)
            residual = x.float() if residual is None else residual + x
            return self._norm(residual).to(x.dtype), residual
        residual = x if residual is None else residual + x
        return self._norm(residual), residual


def _kernel_takes(ops: CpuLayerOps, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the CPU kernel takes x and a float32 residual stream."""
    if not ops.takes(x):
        return False
    return residual is None or (residual.dtype == torch.float32 and ops.takes(residual))
