"""The batch-invariant matmul (issue 40): ``x @ w.T`` whose every output
element is summed in float32 over K in one fixed order, whatever the number
of rows.

:func:`invariant_matmul` multiplies x ``[M, K]`` by w ``[N, K]`` (float32,
float16 or bfloat16, one dtype) into ``[M, N]`` of ``out_dtype`` (x's dtype
for a linear layer, float32 for the LM head's logits). One tile
configuration (:data:`TILE`: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for
every M, no split-K, no autotune: an output element is the sum of its
BLOCK_K-wide ``tl.dot`` chunks in K order, each chunk's instruction the same
whatever M is, so row i of the result is the same bits whether it comes
alone (a decode), with k others of its request (a speculative verify) or
among hundreds of rows (a prefill chunk). Rows past M and columns past N
are masked loads (zeros), which touch no other element's sum. float32
inputs multiply in IEEE float32 (no TF32). The grid is the shape's tiles
only: no host sync, CUDA-graph safe.

May import torch and triton only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["TILE", "MatmulTile", "invariant_matmul"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MatmulTile:
    """The one launch configuration of every M (changing it changes the bits,
    never their independence of M)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: 64 rows: one warpgroup's MMA shape on Hopper, for M = 1 as for M = 4096.
TILE = MatmulTile(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


# M changes every step: one compiled variant for every M (no M == 1 or
# multiple-of-16 specialisation, which could compile the dot otherwise).
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_xm: tl.tensor,
    stride_xk: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> None:
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``: one output tile, its K
    loop from 0 up in BLOCK_K steps, a float32 accumulator."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def invariant_matmul(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ weight.T`` as a new contiguous tensor of ``out_dtype`` (None:
    x's dtype): x ``[..., K]`` (its leading dimensions flattened into rows;
    any strides), weight ``[N, K]`` of x's dtype (any strides). ValueError for
    shapes, dtypes or devices that do not fit."""
    _check_args(x, weight, out_dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        return out.zero_().view(*lead, n)
    t = TILE
    _invariant_matmul_kernel[(triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))](
        x2,
        weight,
        out,
        m,
        n,
        k,
        *x2.stride(),
        *weight.stride(),
        *out.stride(),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out.view(*lead, n)


def _check_args(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None) -> None:
    """Raise ValueError, with one line, for arguments invariant_matmul cannot take."""
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(
            f"x must be [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's K {x.shape[-1]} != weight's K {weight.shape[1]}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float dtype, got {x.dtype}, {weight.dtype}")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise ValueError(f"out_dtype must be one of {_DTYPES}, got {out_dtype}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")
