"""The op-set protocol: a decoder layer's non-matmul ops as one object.

An :class:`OpSet` computes RMSNorm, the residual add + RMSNorm, the gated
MLP's ``silu(gate) * up`` and the rotary embedding of q and k; every
implementation gives :class:`~asyncstep.ops.torch_ref.TorchOps`' results
(bit for bit, or within the rounding its module states).

May import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["OpSet", "RotaryCosSin"]


@dataclass
class RotaryCosSin:
    """A step's rotation: each token's position and, where the op set
    rotates with torch, the cos and sin of its angles ([tokens, 1,
    head_dim / 2] each; a fused kernel reads them from the cache by position)."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


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
