"""The matmul of a step of a few rows on dense 16-bit weights: ``x @ w.T``
for ``2 <= T <= 32`` rows of ``x`` (bfloat16 or float16) and a ``[N, K]``
weight of its dtype, as a decode step of a few requests runs it.

Such a step reads every weight once for a few rows: a memory-bound
matmul, which cuBLAS runs with split-K and a reduce kernel for some
shapes, and without programmatic dependent launch. :func:`small_t_gemm`
streams each program's ``BLOCK_N`` rows of the weight in ``BLOCK_K``-wide
chunks against every row of x (``BLOCK_T`` rows, zeros past T) by
``tl.dot``, sums in float32 from k = 0 chunk by chunk, adds the optional
bias in float32 and rounds once. A row's outputs do not depend on the
other rows (the products of a row with each chunk are that row's; zero
rows add nothing), but the tile's shape follows T's power of two, so a
row's bits may differ between batch sizes (the batch-invariant op set
does not use it). Launched with programmatic dependent launch where the
GPU has it (:mod:`asyncstep.ops.triton.pdl`): a program loads its first
weight chunk before it waits for the kernel before (the weight is
nobody's output in the step; x may be the kernel before's).

The launcher computes its grid from shapes only and allocates with torch
(capturable in a CUDA graph once warmed up) and raises ``ValueError`` for
mismatched shapes, dtypes or devices. On the CPU the kernel runs under the
Triton interpreter (``TRITON_INTERPRET=1``), which the tests use.

May import torch, triton and :mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior

__all__ = ["SMALL_T_MAX_ROWS", "SmallTLaunch", "small_t_gemm", "small_t_launch"]

#: The most rows :func:`small_t_gemm` takes.
SMALL_T_MAX_ROWS = 32
_DTYPES = (torch.bfloat16, torch.float16)


class SmallTLaunch(NamedTuple):
    """Weight rows a program, features a loop step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def small_t_launch(n: int, k: int) -> SmallTLaunch:
    """The launch for an ``[n, k]`` weight."""
    launch = SmallTLaunch(16, 256, 4, 4)
    return launch._replace(block_k=min(launch.block_k, max(16, triton.next_power_of_2(k))))


@triton.jit
def _small_t_gemm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    T,
    N,
    K,
    stride_xt,
    stride_wn,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``out[t, n] = sum_k x[t, k] w[n, k] (+ bias[n])`` for this program's
    rows of w and every row of x, summed in float32 chunk by chunk from
    k = 0. PDL: the first chunk of w loaded before the wait for the kernel
    before. UPCAST multiplies float32 copies of the tiles (the interpreter's
    dot cannot take bfloat16)."""
    launch_dependents(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    t = tl.arange(0, BLOCK_T)
    t_mask = t < T
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_xt + k[None, :]
    w = tl.load(w_rows, mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
    wait_prior(PDL)
    x = tl.load(x_rows, mask=t_mask[:, None] & (k < K)[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    acc = tl.dot(x, tl.trans(w))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k_mask = (k0 + k < K)[None, :]
        w = tl.load(w_rows + k0, mask=n_mask[:, None] & k_mask, other=0.0)
        x = tl.load(x_rows + k0, mask=t_mask[:, None] & k_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + t.to(tl.int64)[:, None] * stride_ot + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :])


def small_t_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    launch: SmallTLaunch | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[..., K]`` of 1 to
    :data:`SMALL_T_MAX_ROWS` rows (bfloat16 or float16), ``weight``
    ``[N, K]`` of its dtype and device with unit stride along K, and an
    optional ``bias`` ``[N]`` (any float dtype, on the device; added in
    float32 before the one rounding); in x's dtype, shaped ``[..., N]``."""
    n, k = _check(x, weight, bias)
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    t = rows.shape[0]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    cfg = launch or small_t_launch(n, k)
    if n and k and t:
        _small_t_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
            rows,
            weight,
            bias.contiguous() if bias is not None else weight,  # any pointer: HAS_BIAS is off
            out,
            t,
            n,
            k,
            rows.stride(0),
            weight.stride(0),
            out.stride(0),
            BLOCK_T=max(16, triton.next_power_of_2(t)),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            HAS_BIAS=bias is not None,
            UPCAST=x.device.type != "cuda",
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **pdl.launch_kwargs(rows),
        )
    elif bias is not None:
        out.copy_(bias.to(out.dtype).expand_as(out))
    else:
        out.zero_()
    return out.reshape(*x.shape[:-1], n)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"small_t_gemm takes bfloat16 or float16 x and a weight of its dtype, got "
            f"{x.dtype} and {weight.dtype}"
        )
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [N, K] with unit stride along K, got {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k or x.numel() > SMALL_T_MAX_ROWS * k:
        raise ValueError(
            f"x must hold at most {SMALL_T_MAX_ROWS} rows of {k} features, got {tuple(x.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, the weight on {weight.device}")
    if bias is not None and (
        tuple(bias.shape) != (n,) or not bias.is_floating_point() or bias.device != x.device
    ):
        raise ValueError(
            f"bias must be a float [{n}] on {x.device}, got {bias.dtype} "
            f"{tuple(bias.shape)} on {bias.device}"
        )
    return n, k
