"""The CPU library's op set: the residual add + RMSNorm over a float32
residual stream, RMSNorm, and ``silu(gate) * up`` in one call each of
``cpu_kernels.c`` (:class:`~asyncstep.ops.cpu.layer_ops.CpuLayerOps`: torch's
float32 arithmetic, bit for bit on x86); the reference's ops where the
library does not take the input (float16, a residual stream that is not
float32), and for the rotary embedding (the CPU attention kernel rotates q
and k as it reads them).

May import torch and :mod:`asyncstep.ops`' base, reference and CPU library.
"""

from __future__ import annotations

import torch

from asyncstep.ops.cpu.layer_ops import CpuLayerOps
from asyncstep.ops.torch_ref import TorchOps

__all__ = ["CpuOps"]


class CpuOps(TorchOps):
    """The CPU library's layer ops, with the reference's where they do not apply."""

    name = "cpu"

    def __init__(self, layer_ops: CpuLayerOps) -> None:
        self.layer_ops = layer_ops

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, float32_residual: bool
    ) -> torch.Tensor:
        if float32_residual and self.layer_ops.takes_vectors(x):
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
        if float32_residual and self._takes(x, residual):
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
