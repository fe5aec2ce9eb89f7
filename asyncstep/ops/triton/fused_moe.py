"""The fused mixture-of-experts (issue 41, vLLM's ``fused_experts``): each
token through its top-k experts' gated MLPs, weighted and summed, in three
Triton kernels after the alignment's two, or in two at small T
(:mod:`asyncstep.ops.triton.fused_moe_kernels`).

:func:`fused_experts` takes hidden ``[T, H]``, w13 ``[E, 2I, H]``, w2
``[E, H, I]`` (hidden's dtype: float32, float16 or bfloat16),
topk_weights ``[T, k]`` (float32) and topk_ids ``[T, k]`` (int32 or int64,
each in ``[0, E)``; not checked: that would sync with the device) and
returns ``[T, H]`` of hidden's dtype::

    out[t] = sum_j topk_weights[t, j] * (act(x[t] @ w13[e].T + b13[e]) @ w2[e].T + b2[e])

with ``e = topk_ids[t, j]`` and the optional biases ``w13_bias [E, 2I]``
and ``w2_bias [E, H]`` (gpt-oss's experts). **w13's layout is the same for
every activation: the expert's I gate rows, then its I up rows** (column
n's gate is row n, its up row I + n; ``gate_up = x @ w13[e].T`` splits in
halves). The activations:

* ``"silu"``: ``silu(gate) * up``.
* ``"swigluoai"`` (gpt-oss): ``gate = min(gate, limit)``, ``up =
  clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha * gate)``,
  alpha 1.702 and limit 7.0. gpt-oss's checkpoints (and transformers' and
  vLLM's ``swigluoai_and_mul``) interleave gate and up (gate at even
  positions, up at odd); a loader turns them into this layout once with
  :func:`gate_up_from_interleaved`. The kernel reads the interleaved
  layout too (``interleaved_gate_up=True``), for the studies.

The grouped path: :func:`~asyncstep.ops.triton.moe_routing.moe_align_block_size`
lists the pairs ``p = t * k + j`` by expert, each run padded to BLOCK_M;
gate/up computes a block's rows with the activation in its epilogue; down
adds the bias and the routing weight (float32 ``[pairs, H]``); the combine
sums a token's k rows in float32, j from 0 up, and rounds once. The small-T
path (``T * k <= gemv_max_pairs``, :data:`GEMV_MAX_PAIRS`): no alignment;
a GEMV-shaped gate/up kernel a program per (pair, columns), then a down
kernel a program per (token, columns) with the bias, the weight and the
combine fused; its bits differ from the grouped GEMM's by roundings.

Batch invariance: the grouped GEMM has one tile (:data:`TILE`) for every
T, no split-K, each element's K loop from 0 up, so a token's output is the
same bits alone or in any batch; the small-T path computes each pair and
each token alone. The path depends on T: a batch-invariant caller passes
``gemv_max_pairs=0`` (the batch-invariant op set does). float32 multiplies
in IEEE float32 (no TF32). Grids are sized from shapes alone: no host sync.

May import torch, triton, :mod:`asyncstep.ops.triton.fused_moe_kernels`,
:mod:`asyncstep.ops.triton.fused_moe_gemv` and
:mod:`asyncstep.ops.triton.moe_routing`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from asyncstep.ops.triton import fused_moe_kernels as kernels
from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.fused_moe_gemv import (
    GEMV_MAX_PAIRS,
    GEMV_TILE,
    GemvTile,
    default_gemv_tile,
    small_t_experts,
)
from asyncstep.ops.triton.fused_moe_kernels import ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT
from asyncstep.ops.triton.moe_routing import MoeAlignment, max_blocks, moe_align_block_size

__all__ = [
    "ACTIVATIONS",
    "GEMV_MAX_PAIRS",
    "GEMV_TILE",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "TILE",
    "GemvTile",
    "MoeAlignment",
    "MoeTile",
    "fused_experts",
    "gate_up_from_interleaved",
    "max_blocks",
    "moe_align_block_size",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


#: Under the interpreter, 16-bit brain floats are multiplied as float32
#: copies (its dot takes numpy's dtypes; the products are exact either way).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class MoeTile:
    """The launch configuration of both GEMMs (BLOCK_M is also the expert
    runs' padding) and of the combine (BLOCK_H columns a program)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_h: int = 256


#: One tile for every T: 16 pairs a block (a decode step's expert holds one
#: or a few pairs; a prefill's tens), 64 columns, 64-wide K steps.
TILE = MoeTile(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)


def gate_up_from_interleaved(
    w13: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w13 ``[E, 2I, H]`` (and bias ``[E, 2I]``) with gate and up
    interleaved (gate rows at even positions: gpt-oss's ``gate_up_proj``
    transposed) as gate rows then up rows, new contiguous tensors."""
    w = torch.cat((w13[:, 0::2], w13[:, 1::2]), dim=1).contiguous()
    b = None if bias is None else torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1).contiguous()
    return w, b


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    interleaved_gate_up: bool = False,
    tile: MoeTile = TILE,
    gemv_max_pairs: int = GEMV_MAX_PAIRS,
    gemv_tile: GemvTile | None = None,
) -> torch.Tensor:
    """The experts' weighted sum ``[T, H]`` of hidden's dtype (the module's
    contract). ``interleaved_gate_up``: w13 (and w13_bias) interleave gate
    and up rows instead. ``T * k <= gemv_max_pairs``: the small-T path
    (``gemv_tile``; by default GEMV_TILE on CUDA, a wider one under the
    interpreter), else the grouped GEMM (``tile``). ValueError for
    shapes, dtypes, devices or an activation that do not fit."""
    _check_args(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    num_tokens, hidden_size = hidden.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or top_k == 0 or hidden_size == 0:
        return out.zero_()
    if num_tokens * top_k <= gemv_max_pairs:
        weights = topk_weights.to(torch.float32)
        experts = (w13, w2, w13_bias, w2_bias)
        gemv = gemv_tile or default_gemv_tile(hidden.device)
        small_t_experts(
            hidden, experts, weights, topk_ids, activation, interleaved_gate_up, gemv, out
        )
        return out
    align = moe_align_block_size(topk_ids, num_experts, tile.block_m)
    act = _gate_up(hidden, w13, w13_bias, align, top_k, activation, interleaved_gate_up, tile)
    route = topk_weights.to(torch.float32).reshape(-1).contiguous()
    pairs = _down(act, w2, w2_bias, route, align, tile)
    _combine(pairs, out, top_k, tile)
    return out


def _dot_args(dtype: torch.dtype) -> dict[str, object]:
    """The dot's precision (IEEE for float32: no TF32) and the interpreter's upcast."""
    upcast = _INTERPRETED and dtype == torch.bfloat16
    precise = upcast or dtype == torch.float32
    return {"DOT_PRECISION": "ieee" if precise else "tf32", "UPCAST": upcast}


def _gate_up(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    bias: torch.Tensor | None,
    align: MoeAlignment,
    top_k: int,
    activation: str,
    interleaved: bool,
    tile: MoeTile,
) -> torch.Tensor:
    """``act(gate, up)`` of every pair, ``[pairs, I]`` of hidden's dtype."""
    inter = w13.shape[1] // 2
    out = torch.empty((align.num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    grid = (align.expert_ids.numel(), triton.cdiv(inter, tile.block_n))
    b = bias if bias is not None else w13  # any pointer: HAS_BIAS is off
    b_strides = bias.stride() if bias is not None else (0, 0)
    kernels.gate_up_kernel[grid](
        hidden,
        w13,
        b,
        align.sorted_ids,
        align.expert_ids,
        out,
        align.num_pairs,
        top_k,
        inter,
        hidden.shape[1],
        1 if interleaved else inter,
        *hidden.stride(),
        *w13.stride(),
        *b_strides,
        *out.stride(),
        SWIGLU_ALPHA,
        SWIGLU_LIMIT,
        ROW_STEP=2 if interleaved else 1,
        HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATIONS[activation],
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        **_dot_args(hidden.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl.launch_kwargs(hidden),
    )
    return out


def _down(
    act: torch.Tensor,
    w2: torch.Tensor,
    bias: torch.Tensor | None,
    route: torch.Tensor,
    align: MoeAlignment,
    tile: MoeTile,
) -> torch.Tensor:
    """``route[p] * (act[p] @ w2[e].T + b2[e])`` of every pair, float32 ``[pairs, H]``."""
    hidden_size, inter = w2.shape[1], w2.shape[2]
    out = torch.empty((align.num_pairs, hidden_size), dtype=torch.float32, device=act.device)
    grid = (align.expert_ids.numel(), triton.cdiv(hidden_size, tile.block_n))
    b = bias if bias is not None else w2
    b_strides = bias.stride() if bias is not None else (0, 0)
    kernels.down_kernel[grid](
        act,
        w2,
        b,
        route,
        align.sorted_ids,
        align.expert_ids,
        out,
        align.num_pairs,
        hidden_size,
        inter,
        *act.stride(),
        *w2.stride(),
        *b_strides,
        *out.stride(),
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        **_dot_args(act.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl.launch_kwargs(act),
    )
    return out


def _combine(pairs: torch.Tensor, out: torch.Tensor, top_k: int, tile: MoeTile) -> None:
    """``out[t] = sum_j pairs[t * k + j]`` (j from 0 up, float32), in out's dtype."""
    num_tokens, hidden_size = out.shape
    grid = (num_tokens, triton.cdiv(hidden_size, tile.block_h))
    kernels.combine_kernel[grid](
        pairs,
        out,
        hidden_size,
        pairs.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_H=tile.block_h,
        **pdl.launch_kwargs(out),
    )


def _check_args(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
) -> None:
    """Raise ValueError, with one line, for arguments fused_experts cannot take."""
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            "hidden must be [T, H], w13 [E, 2I, H] and w2 [E, H, I], got "
            f"{tuple(hidden.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    t, h = hidden.shape
    e, i = w2.shape[0], w2.shape[2]
    if e == 0 or i == 0:
        raise ValueError(f"need at least one expert and I > 0, got w2 {tuple(w2.shape)}")
    if tuple(w13.shape) != (e, 2 * i, h) or w2.shape[1] != h:
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden size {h}: "
            "w13 must be [E, 2I, H], w2 [E, H, I]"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
            f"must both be [T, k] with T = {t}"
        )
    if hidden.dtype not in _DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(
            "hidden, w13 and w2 must share a float dtype, got "
            f"{hidden.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_ids must be int32 or int64 and topk_weights float, got "
            f"{topk_ids.dtype}, {topk_weights.dtype}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    for name, bias, shape in (("w13_bias", w13_bias, (e, 2 * i)), ("w2_bias", w2_bias, (e, h))):
        if bias is not None and (tuple(bias.shape) != shape or not bias.is_floating_point()):
            raise ValueError(f"{name} must be float {shape}, got {bias.dtype} {tuple(bias.shape)}")
    tensors = [hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias]
    devices = {x.device for x in tensors if x is not None}
    if len(devices) != 1:
        raise ValueError(f"the tensors must be on one device, got {sorted(map(str, devices))}")
