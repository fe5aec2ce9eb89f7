"""The GEMV of a one-row step on dense 16-bit weights: ``x @ w.T`` for one
row of ``x`` (bfloat16 or float16) and a ``[N, K]`` weight of its dtype.

A decode step of one request reads every weight once for one row; cuBLAS
runs it as a GEMV, on the 4096-row weights of an 8B model with a split-K
and a separate reduce kernel. :func:`dense_gemv` streams each program's
``BLOCK_N`` rows in ``BLOCK_K``-wide chunks, accumulates the products in
float32 and sums each row once at the end, adding the optional bias in
float32 (one rounding to x's dtype; no launch of its own). Launched with
programmatic dependent launch where the GPU has it
(:mod:`asyncstep.ops.triton.pdl`), a program loads its first weight chunk
while the kernel before still runs: the weight must be nobody's output in
the step (a model's parameter), x may be the kernel before's.
The launch (:func:`gemv_launch`) is picked by measurement on llama-8b's and
llama-1b's shapes (the study and its figures:
``benchmarks/studies/decode_kernels/README.md``).

The launcher computes its grid from shapes only and allocates with torch
(no host sync: capturable in a CUDA graph once warmed up) and raises
``ValueError`` for mismatched shapes, dtypes or devices. On the CPU the
kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``), which
the tests use.

May import torch, triton and :mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior

__all__ = ["GemvLaunch", "dense_gemv", "gemv_launch"]

_DTYPES = (torch.bfloat16, torch.float16)


class GemvLaunch(NamedTuple):
    """Rows a program, features a loop step, warps."""

    block_n: int
    block_k: int
    num_warps: int


def gemv_launch(n: int, k: int) -> GemvLaunch:
    """The launch for an ``[n, k]`` weight (picked by measurement): narrow
    weights (``k <= 2048``) and weights of few rows take wide steps of few
    rows; the tallest (>= 16384 rows) 256-feature steps of 8 rows; the
    rest 512-feature steps."""
    if k <= 2048:
        launch = GemvLaunch(4, 1024, 4)
    elif n >= 16384:
        launch = GemvLaunch(8, 256, 2)
    elif n <= 2048:
        launch = GemvLaunch(2, 1024, 4)
    else:
        launch = GemvLaunch(8 if n >= 6144 else 4, 512, 4)
    return launch._replace(block_k=min(launch.block_k, triton.next_power_of_2(k)))


@triton.jit
def _weight_chunk(rows, k0, k, n_mask, K, EVEN: tl.constexpr):  # type: ignore[no-untyped-def]
    """The program's rows of w at features ``k0 + k`` (zeros past N and K)."""
    if EVEN:
        return tl.load(rows + k0)
    return tl.load(rows + k0, mask=n_mask[:, None] & (k0 + k < K)[None, :], other=0.0)


@triton.jit
def _x_chunk(x_ptr, k0, k, K, EVEN: tl.constexpr):  # type: ignore[no-untyped-def]
    """x at features ``k0 + k`` (zeros past K)."""
    if EVEN:
        return tl.load(x_ptr + k0 + k)
    return tl.load(x_ptr + k0 + k, mask=k0 + k < K, other=0.0)


@triton.jit
def _dense_gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``out[n] = sum_k w[n, k] x[k] (+ bias[n])`` for this program's rows
    (EVEN: every tile inside, unmasked), summed in float32, chunk by chunk
    from k = 0. PDL: the first chunk of w loaded before the wait for the
    kernel before (the weight is nobody's output; x is)."""
    launch_dependents(PDL)  # the next kernel (with PDL) may launch: it waits for this one
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w = _weight_chunk(rows, 0, k, n_mask, K, EVEN)
    wait_prior(PDL)
    acc += w.to(tl.float32) * _x_chunk(x_ptr, 0, k, K, EVEN).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _weight_chunk(rows, k0, k, n_mask, K, EVEN)
        acc += w.to(tl.float32) * _x_chunk(x_ptr, k0, k, K, EVEN).to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    launch: GemvLaunch | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[..., K]`` holding one row
    (bfloat16 or float16), ``weight`` ``[N, K]`` of its dtype and device,
    with unit stride along K, and an optional ``bias`` ``[N]`` (any float
    dtype, on the device; added in float32 before the one rounding); in
    x's dtype, shaped ``[..., N]``."""
    _check(x, weight)
    n, k = weight.shape
    if bias is not None and (
        tuple(bias.shape) != (n,) or not bias.is_floating_point() or bias.device != x.device
    ):
        raise ValueError(
            f"bias must be a float [{n}] on {x.device}, got {bias.dtype} "
            f"{tuple(bias.shape)} on {bias.device}"
        )
    x1 = x.reshape(k).contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    cfg = launch or gemv_launch(n, k)
    if n and k:
        _dense_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x1,
            weight,
            bias.contiguous() if bias is not None else weight,  # any pointer: HAS_BIAS is off
            out,
            n,
            k,
            weight.stride(0),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
            HAS_BIAS=bias is not None,
            num_warps=cfg.num_warps,
            **pdl.launch_kwargs(x1),
        )
    elif bias is not None:
        out.copy_(bias)
    else:
        out.zero_()
    return out.reshape(*x.shape[:-1], n)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"dense_gemv takes bfloat16 or float16 x and a weight of its dtype, got "
            f"{x.dtype} and {weight.dtype}"
        )
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [N, K] with unit stride along K, got {tuple(weight.shape)}"
        )
    k = weight.shape[1]
    if x.dim() == 0 or x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"x must hold one row of {k} features, got {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, the weight on {weight.device}")
