"""Rotary position embedding (neox / HF "rotate_half" style), with the
default, linear and llama3 frequency schedules: the cos/sin cache, and the
calls of the model's op set (:class:`~asyncstep.ops.OpSet`) that rotate."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from asyncstep.errors import UnsupportedModelError
from asyncstep.ops.base import RotaryCosSin
from asyncstep.ops.slot import OpSetSlot

__all__ = ["RotaryCosSin", "RotaryEmbedding"]


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r} (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q and k given each token's position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        ops: OpSetSlot | None = None,
    ) -> None:
        """``ops``: the model's op-set slot (a slot of its own holding the
        reference when None)."""
        super().__init__()
        self.head_dim = head_dim
        self.ops = ops or OpSetSlot()
        freqs = (
            torch.arange(max_position, dtype=torch.float32)[:, None]
            * _inv_freq(head_dim, theta, scaling)[None, :]
        )
        # [max_position, head_dim]: cos in the first half, sin in the second, written
        # in place (the angles and the cache are all that is alive at once).
        cache = torch.empty(max_position, head_dim, dtype=torch.float32)
        torch.cos(freqs, out=cache[:, : head_dim // 2])
        torch.sin(freqs, out=cache[:, head_dim // 2 :])
        del freqs
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache, False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryCosSin:
        """The step's rotation, looked up once and shared by every layer."""
        return self.ops.ops.rotary_cos_sin(self.cos_sin_cache, positions, dtype)

    def forward(
        self, cos_sin: RotaryCosSin, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads * head_dim], k: [tokens, kv_heads * head_dim]
        (an op set may rotate them in place)."""
        return self.ops.ops.rotary(cos_sin, q, k, self.cos_sin_cache, self.head_dim)
