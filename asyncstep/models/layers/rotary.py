"""Rotary position embedding (neox / HF "rotate_half" style), with the
default, linear and llama3 frequency schedules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncstep.errors import UnsupportedModelError


@dataclass
class RotaryCosSin:
    """A step's rotation: each token's position and, for the torch path,
    the cos and sin of its angles ([tokens, 1, head_dim / 2] each; the
    fused Triton kernel reads them from the cache by position)."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


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
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
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
        #: Rotate with the fused Triton kernel (set by the runner on CUDA).
        self.use_triton = False

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.view(shape)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryCosSin:
        """The step's cos and sin, looked up once and shared by every layer
        (the fused kernel looks them up itself)."""
        if self.use_triton:
            return RotaryCosSin(positions)
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        cos, sin = cos_sin.chunk(2, dim=-1)
        return RotaryCosSin(positions, cos, sin)

    def forward(
        self, cos_sin: RotaryCosSin, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads * head_dim], k: [tokens, kv_heads * head_dim]
        (the Triton path rotates them in place)."""
        if cos_sin.cos is None or cos_sin.sin is None:
            from asyncstep.gpu.triton_fused import rotary_embedding

            return rotary_embedding(cos_sin.positions, q, k, self.cos_sin_cache, self.head_dim)
        return self._rotate(q, cos_sin.cos, cos_sin.sin), self._rotate(k, cos_sin.cos, cos_sin.sin)
