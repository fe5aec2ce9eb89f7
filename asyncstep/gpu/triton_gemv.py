"""The GEMV of a one-row step on dense 16-bit weights: ``x @ w.T`` for one
row of ``x`` (bfloat16 or float16) and a ``[N, K]`` weight of its dtype.

A decode step of one request reads every weight once for one row; cuBLAS
runs it as a GEMV, on the 4096-row weights of an 8B model with a split-K
and a separate reduce kernel. :func:`dense_gemv` streams each program's
``BLOCK_N`` rows in ``BLOCK_K``-wide chunks, accumulates the products in
float32 and sums each row once at the end (one rounding to x's dtype).
The launch (:func:`gemv_launch`) is picked by measurement on llama-8b's and
llama-1b's shapes (``benchmarks/dense_gemv.py``; figures in
``benchmarks/results/fused_decode/README.md``).

The launcher computes its grid from shapes only and allocates with torch
(no host sync: capturable in a CUDA graph once warmed up) and raises
``ValueError`` for mismatched shapes, dtypes or devices. On the CPU the
kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``), which
the tests use.

May import torch and triton only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from asyncstep.gpu.triton_quant import NormedRows

__all__ = ["GemvLaunch", "dense_gemv", "dense_gemv_fused", "gemv_launch"]

_DTYPES = (torch.bfloat16, torch.float16)


class GemvLaunch(NamedTuple):
    """Rows a program, features a loop step, warps."""

    block_n: int
    block_k: int
    num_warps: int


def gemv_launch(n: int, k: int) -> GemvLaunch:
    """The launch for an ``[n, k]`` weight (measured on an H200): narrow
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
def _dense_gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
):
    """``out[n] = sum_k w[n, k] x[k]`` for this program's rows (EVEN: every
    tile inside, unmasked)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(rows + k0)
            x = tl.load(x_ptr + k0 + k)
        else:
            k_mask = k0 + k < K
            w = tl.load(rows + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n, out, mask=n_mask)


def dense_gemv(
    x: torch.Tensor, weight: torch.Tensor, launch: GemvLaunch | None = None
) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` ``[..., K]`` holding one row (bfloat16 or
    float16) and ``weight`` ``[N, K]`` of its dtype and device, with unit
    stride along K; in x's dtype, shaped ``[..., N]``."""
    _check(x, weight)
    n, k = weight.shape
    x1 = x.reshape(k).contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    cfg = launch or gemv_launch(n, k)
    if n and k:
        _dense_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x1,
            weight,
            out,
            n,
            k,
            weight.stride(0),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
            num_warps=cfg.num_warps,
        )
    else:
        out.zero_()
    return out.reshape(*x.shape[:-1], n)


#: The fused GEMV's prologue (as :mod:`asyncstep.gpu.triton_quant`'s): x as
#: it is; ``rms_norm(x) * weight`` (every program reads the whole row and
#: sums its squares); or x already times the norm's weight, its squares
#: summed in parts by the kernel that wrote it.
_PROLOGUE_NONE: tl.constexpr = tl.constexpr(0)
_PROLOGUE_RMS_NORM: tl.constexpr = tl.constexpr(1)
_PROLOGUE_NORMED: tl.constexpr = tl.constexpr(2)


@triton.jit
def _dense_gemv_fused_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    nw_ptr,
    sq_ptr,
    res_ptr,
    next_nw_ptr,
    xw_ptr,
    sq_out_ptr,
    N,
    K,
    stride_wn,
    n_sq_parts,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    PROLOGUE: tl.constexpr,
    SQ_BLOCK: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SILU_HALVES: tl.constexpr,
    NEXT_NORM: tl.constexpr,
):
    """:func:`_dense_gemv_kernel` with the fused decode's prologue and
    epilogues (see :func:`dense_gemv_fused`); ``N`` output features (with
    SILU_HALVES: rows ``n`` and ``N + n`` of the weight make feature ``n``)."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    rows = w_ptr + n64[:, None] * stride_wn + k[None, :]
    up_rows = rows + N * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptr + k0 + k).to(tl.float32)
            w = tl.load(rows + k0)
            if SILU_HALVES:
                wu = tl.load(up_rows + k0)
        else:
            k_mask = k0 + k < K
            x = tl.load(x_ptr + k0 + k, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = n_mask[:, None] & k_mask[None, :]
            w = tl.load(rows + k0, mask=w_mask, other=0.0)
            if SILU_HALVES:
                wu = tl.load(up_rows + k0, mask=w_mask, other=0.0)
        if PROLOGUE == _PROLOGUE_RMS_NORM:
            sq_acc += x * x
            if EVEN:
                x = x * tl.load(nw_ptr + k0 + k).to(tl.float32)
            else:
                x = x * tl.load(nw_ptr + k0 + k, mask=k_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if SILU_HALVES:
            up_acc += wu.to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if PROLOGUE == _PROLOGUE_RMS_NORM:
        out = out * tl.rsqrt(tl.sum(sq_acc, axis=0) / K + eps)
    elif PROLOGUE == _PROLOGUE_NORMED:
        parts = tl.arange(0, SQ_BLOCK)
        sq = tl.load(sq_ptr + parts, mask=parts < n_sq_parts, other=0.0)
        out = out * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    dtype = out_ptr.dtype.element_ty
    if RESIDUAL:
        # As the unfused layer: the product rounded to the output's dtype,
        # then the residual added in float32 and rounded again.
        res = tl.load(res_ptr + n64, mask=n_mask, other=0.0).to(tl.float32)
        out = out.to(dtype).to(tl.float32) + res
    if SILU_HALVES:
        up = tl.sum(up_acc, axis=1)
        if PROLOGUE == _PROLOGUE_RMS_NORM:
            up = up * tl.rsqrt(tl.sum(sq_acc, axis=0) / K + eps)
        elif PROLOGUE == _PROLOGUE_NORMED:
            up = up * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        # silu(gate) * up, each rounded to the output's dtype first, as
        # silu_and_mul reads and stores them.
        gate = out.to(dtype).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up.to(dtype).to(tl.float32)
    stored = out.to(dtype)
    tl.store(out_ptr + n64, stored, mask=n_mask)
    if NEXT_NORM:
        # The next RMS norm's input: the output (as stored) times the norm's
        # weight, rounded, and this program's part of its sum of squares.
        stream = stored.to(tl.float32)
        weight = tl.load(next_nw_ptr + n64, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(xw_ptr + n64, (stream * weight).to(xw_ptr.dtype.element_ty), mask=n_mask)
        tl.store(sq_out_ptr + pid, tl.sum(tl.where(n_mask, stream * stream, 0.0), axis=0))


def dense_gemv_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    rms_norm_weight: torch.Tensor | None = None,
    sq_parts: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_halves: bool = False,
    next_rms_norm_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    launch: GemvLaunch | None = None,
) -> tuple[torch.Tensor, NormedRows | None]:
    """:func:`dense_gemv` with the fused decode's prologue and epilogues, as
    :func:`asyncstep.gpu.triton_quant.q4_gemv_fused` has them for Q4
    weights (the same arguments and rounding), but for ``silu_halves``:
    the weight's rows are two stacked halves (gate rows, then up rows, as
    the merged layer stores them) and ``out[:, j] = silu(gate_j) * up_j``.
    Returns ``(out, normed)``."""
    from asyncstep.gpu.triton_quant import NormedRows, _check_vector

    _check(x, weight)
    n, k = weight.shape
    if silu_halves and (n % 2 or residual is not None or next_rms_norm_weight is not None):
        raise ValueError("silu_halves takes an even row count, and no residual or next norm")
    if rms_norm_weight is not None and sq_parts is not None:
        raise ValueError("one prologue at a time: rms_norm_weight or sq_parts")
    features = n // 2 if silu_halves else n
    dtype = out_dtype or x.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"out_dtype must be bfloat16 or float16, got {dtype}")
    device = x.device
    x1 = x.reshape(k).contiguous()
    out = torch.empty(features, dtype=dtype, device=device)
    cfg = launch or gemv_launch(n, k)
    block_n = max(cfg.block_n // 2, 1) if silu_halves else cfg.block_n
    prologue, nw, sq = 0, x1, out  # (unused pointers: out)
    if rms_norm_weight is not None:
        _check_vector("rms_norm_weight", rms_norm_weight, k, device)
        prologue, nw = 1, rms_norm_weight.contiguous()
    elif sq_parts is not None:
        if sq_parts.dtype != torch.float32 or sq_parts.numel() != sq_parts.shape[-1]:
            raise ValueError(f"sq_parts must be float32 (1, parts), got {tuple(sq_parts.shape)}")
        prologue, sq = 2, sq_parts.reshape(-1).contiguous()
    res = out
    if residual is not None:
        res = residual.reshape(-1)
        if res.shape != out.shape or res.dtype != dtype or res.device != device:
            raise ValueError(
                f"residual must be {dtype} ({features},) on {device}, got {residual.dtype} "
                f"{tuple(residual.shape)} on {residual.device}"
            )
        res = res.contiguous()
    normed = None
    next_nw = xw = sq_out = out
    if next_rms_norm_weight is not None:
        _check_vector("next_rms_norm_weight", next_rms_norm_weight, features, device)
        next_nw = next_rms_norm_weight.contiguous()
        xw = torch.empty(features, dtype=dtype, device=device)
        sq_out = torch.empty(
            (1, triton.cdiv(features, block_n)), dtype=torch.float32, device=device
        )
        normed = NormedRows(xw.reshape(*x.shape[:-1], features), sq_out)
    if features and k:
        _dense_gemv_fused_kernel[(triton.cdiv(features, block_n),)](
            x1,
            weight,
            out,
            nw,
            sq,
            res,
            next_nw,
            xw,
            sq_out,
            features,
            k,
            weight.stride(0),
            sq.numel(),
            float(eps),
            BLOCK_N=block_n,
            BLOCK_K=cfg.block_k,
            EVEN=features % block_n == 0 and k % cfg.block_k == 0,
            PROLOGUE=prologue,
            SQ_BLOCK=triton.next_power_of_2(sq.numel()) if prologue == 2 else 1,
            RESIDUAL=residual is not None,
            SILU_HALVES=silu_halves,
            NEXT_NORM=next_rms_norm_weight is not None,
            num_warps=cfg.num_warps,
        )
    return out.reshape(*x.shape[:-1], features), normed


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

