"""Rotary position embedding (neox / HF "rotate_half" style), with the
default, linear, llama3 and yarn frequency schedules: the cos/sin cache, and
the calls of the model's op set (:class:`~asyncstep.ops.OpSet`) that rotate.

YaRN (gpt-oss) is transformers' ``_compute_yarn_parameters``: the
frequencies blend interpolated (``/ factor``) and extrapolated ones over a
linear ramp between the correction dimensions of ``beta_fast`` and
``beta_slow`` (floored / ceiled unless ``truncate`` is false), and cos and
sin are both multiplied by its attention factor (``attention_factor``, else
``0.1 * ln(factor) + 1``, or the ratio of the two ``mscale`` terms where
``mscale`` and ``mscale_all_dim`` are given), so q.k scales by its square."""

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
    """The rotation's inverse frequencies ``[head_dim / 2]``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise UnsupportedModelError(
        f"unsupported rope scaling {rope_type!r} (default, linear, llama3, yarn)"
    )


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by (YaRN's; 1 for the others)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    factor = float(scaling["factor"])
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
    return _yarn_get_mscale(factor)


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


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
        scale = attention_factor(scaling)
        if scale != 1.0:
            cache.mul_(scale)
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
