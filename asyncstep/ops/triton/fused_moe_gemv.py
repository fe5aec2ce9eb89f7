"""The fused mixture-of-experts' small-T path (issue 41): at decode's few
token-expert pairs, no alignment and two GEMV-shaped kernels
(:func:`~asyncstep.ops.triton.fused_moe_kernels.gemv_gate_up_kernel`, a
program per (pair, BLOCK_N activation columns), the activation in its
epilogue; :func:`~asyncstep.ops.triton.fused_moe_kernels.gemv_down_kernel`,
a program per (token, down_block_n output columns) over the token's k
experts with the bias, the routing weight and the combine). The contract
is :func:`asyncstep.ops.triton.fused_moe.fused_experts`', which chooses
this path at ``T * k <= gemv_max_pairs`` (:data:`GEMV_MAX_PAIRS`).

May import torch, triton, :mod:`asyncstep.ops.triton.fused_moe_kernels` and
:mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from asyncstep.ops.triton import fused_moe_kernels as kernels
from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.fused_moe_kernels import ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT

__all__ = [
    "GEMV_MAX_PAIRS",
    "GEMV_TILE",
    "INTERPRETER_GEMV_TILE",
    "GemvTile",
    "default_gemv_tile",
    "small_t_experts",
]


@dataclass(frozen=True)
class GemvTile:
    """The small-T path's launches: BLOCK_N activation columns a gate/up
    program, down_block_n output columns a down program (its grid is T
    wide only: narrower, for more programs), BLOCK_K of the weight rows a
    step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    down_block_n: int = 4


#: The small-T path's tile: one column (gate/up: 2 weight rows) of 1024 a
#: step, 2 warps: a program a weight row, wide steps. Chosen on one H100
#: among 30 (``fused_moe_kernel.py --gemv-tile ...``, one layer in a CUDA
#: graph at T = 1; benchmarks/results/gpu_h100_1205e/): qwen3-30b-a3b 34.5
#: us against 42.0 for the earlier 4-column, 512-wide tile, gpt-oss-20b
#: 82.8 against 93.5.
GEMV_TILE = GemvTile(block_n=1, block_k=1024, num_warps=2, num_stages=3, down_block_n=1)

#: The tile off CUDA (the Triton interpreter, the tests): the interpreter
#: runs one program at a time in Python at a cost a program, so wide
#: programs (32 columns, a tiny model's whole layer in one or two) make
#: the small-T path the fewest programs; the kernels' code is the same.
INTERPRETER_GEMV_TILE = GemvTile(
    block_n=32, block_k=512, num_warps=4, num_stages=3, down_block_n=32
)


def default_gemv_tile(device: torch.device) -> GemvTile:
    """GEMV_TILE on CUDA, INTERPRETER_GEMV_TILE elsewhere."""
    return GEMV_TILE if device.type == "cuda" else INTERPRETER_GEMV_TILE


#: The most pairs (``T * top_k``) the small-T path takes (0: never). A
#: decode step's few pairs read each expert's rows once a pair: the GEMV
#: streams them without the alignment or padded blocks; past this many
#: pairs share experts and the grouped GEMM reads each active expert once.
#: Measured on one H100 (``fused_moe_kernel.py --gemv-tiles``,
#: benchmarks/results/moefast/): the small-T path wins at one token
#: (qwen3-30b-a3b, 8 pairs: 42.6 against 52.7 us a layer; gpt-oss-20b, 4
#: pairs: 94.1 against 106.1) and loses from two.
GEMV_MAX_PAIRS = 8


@dataclass(frozen=True)
class GemvArgs:
    """The small-T path's routing (float32 weights, ids ``[T, k]``),
    activation and tile."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: str
    tile: GemvTile


def small_t_experts(
    hidden: torch.Tensor,
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    interleaved: bool,
    tile: GemvTile,
    out: torch.Tensor,
) -> None:
    """The experts' weighted sum into ``out [T, H]`` (hidden's dtype) by the
    two GEMV kernels: ``experts`` is ``(w13, w2, w13_bias, w2_bias)``,
    topk_weights float32 ``[T, k]``; the arguments checked by the caller."""
    w13, w2, w13_bias, w2_bias = experts
    gemv = GemvArgs(topk_weights, topk_ids, activation, tile)
    act = _gemv_gate_up(hidden, w13, w13_bias, gemv, interleaved)
    _gemv_down(act, w2, w2_bias, gemv, out)


def _gemv_gate_up(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    bias: torch.Tensor | None,
    gemv: GemvArgs,
    interleaved: bool,
) -> torch.Tensor:
    """``act(gate, up)`` of every pair ``p = t * k + j``, ``[pairs, I]`` of hidden's dtype."""
    inter, top_k = w13.shape[1] // 2, gemv.topk_ids.shape[1]
    pairs = hidden.shape[0] * top_k
    out = torch.empty((pairs, inter), dtype=hidden.dtype, device=hidden.device)
    b = bias if bias is not None else w13  # any pointer: HAS_BIAS is off
    b_strides = bias.stride() if bias is not None else (0, 0)
    kernels.gemv_gate_up_kernel[(pairs, triton.cdiv(inter, gemv.tile.block_n))](
        hidden,
        w13,
        b,
        gemv.topk_ids,
        out,
        top_k,
        inter,
        hidden.shape[1],
        1 if interleaved else inter,
        *hidden.stride(),
        *gemv.topk_ids.stride(),
        *w13.stride(),
        *b_strides,
        *out.stride(),
        SWIGLU_ALPHA,
        SWIGLU_LIMIT,
        ROW_STEP=2 if interleaved else 1,
        HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATIONS[gemv.activation],
        BLOCK_N=gemv.tile.block_n,
        BLOCK_K=gemv.tile.block_k,
        num_warps=gemv.tile.num_warps,
        num_stages=gemv.tile.num_stages,
        **pdl.launch_kwargs(hidden),
    )
    return out


def _gemv_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    bias: torch.Tensor | None,
    gemv: GemvArgs,
    out: torch.Tensor,
) -> None:
    """``out[t] = sum_j route[t, j] * (act[p] @ w2[e].T + b2[e])``, j from 0 up, in float32."""
    num_tokens, hidden_size = out.shape
    b = bias if bias is not None else w2
    b_strides = bias.stride() if bias is not None else (0, 0)
    kernels.gemv_down_kernel[(num_tokens, triton.cdiv(hidden_size, gemv.tile.down_block_n))](
        act,
        w2,
        b,
        gemv.topk_weights,
        gemv.topk_ids,
        out,
        hidden_size,
        w2.shape[2],
        *act.stride(),
        *gemv.topk_weights.stride(),
        *gemv.topk_ids.stride(),
        *w2.stride(),
        *b_strides,
        *out.stride(),
        TOP_K=gemv.topk_ids.shape[1],
        HAS_BIAS=bias is not None,
        BLOCK_N=gemv.tile.down_block_n,
        BLOCK_K=gemv.tile.block_k,
        num_warps=gemv.tile.num_warps,
        num_stages=gemv.tile.num_stages,
        **pdl.launch_kwargs(act),
    )
