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

May import torch, triton, :mod:`asyncstep.ops.triton.pdl` and the quantized
GEMV's prologue codes and :class:`~asyncstep.ops.triton.quant.NormedRows`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior
from asyncstep.ops.triton.quant import NormedRows
from asyncstep.ops.triton.quant_kernels import PROLOGUE_NONE, PROLOGUE_NORMED, PROLOGUE_RMS_NORM

__all__ = ["GemvLaunch", "dense_gemv", "dense_gemv_fused", "gemv_launch"]

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
def _gemv_step(acc, sq, w, x_ptr, nw_ptr, k0, k, K, EVEN: tl.constexpr, PROLOGUE: tl.constexpr):  # type: ignore[no-untyped-def]
    """The products of weight chunk ``w`` and x at features ``k0 + k`` added
    to ``acc`` (RMS_NORM: x's squares to ``sq``, x times the norm's weight)."""
    xv = _x_chunk(x_ptr, k0, k, K, EVEN).to(tl.float32)
    if PROLOGUE == PROLOGUE_RMS_NORM:
        sq += xv * xv
        xv = xv * _x_chunk(nw_ptr, k0, k, K, EVEN).to(tl.float32)
    acc += w.to(tl.float32) * xv[None, :]
    return acc, sq


@triton.jit
def _dense_gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    bias_ptr,
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
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr = 0,
    SQ_BLOCK: tl.constexpr = 1,
    RESIDUAL: tl.constexpr = False,
    SILU_HALVES: tl.constexpr = False,
    NEXT_NORM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """``out[n] = sum_k w[n, k] x[k] (+ bias[n])`` for this program's rows
    (EVEN: every tile inside, unmasked), summed in float32, chunk by chunk
    from k = 0. PDL: the first chunk of w loaded before the wait for the
    kernel before (the weight is nobody's output; x is). The prologue and
    epilogues are :func:`dense_gemv_fused`'s; SILU_HALVES: the program's
    rows are ``BLOCK_N / 2`` gate rows ``j`` and their up rows ``N / 2 + j``
    (N: the weight's rows), paired."""
    launch_dependents(PDL)  # the next kernel (with PDL) may launch: it waits for this one
    pid = tl.program_id(0)
    if SILU_HALVES:  # row r: gate (r even) or up (r odd) of pair pid * BLOCK_N / 2 + r / 2
        r = tl.arange(0, BLOCK_N)
        pair = pid * (BLOCK_N // 2) + r // 2
        n = pair + (r % 2) * (N // 2)
        n_mask = pair < N // 2
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
    k = tl.arange(0, BLOCK_K)
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    w = _weight_chunk(rows, 0, k, n_mask, K, EVEN)
    wait_prior(PDL)
    if PROLOGUE == PROLOGUE_NORMED:  # the parts' loads ahead of the loop
        parts = tl.arange(0, SQ_BLOCK)
        sq_parts = tl.load(sq_ptr + parts, mask=parts < n_sq_parts, other=0.0)
    acc, sq = _gemv_step(acc, sq, w, x_ptr, nw_ptr, 0, k, K, EVEN, PROLOGUE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = _weight_chunk(rows, k0, k, n_mask, K, EVEN)
        acc, sq = _gemv_step(acc, sq, w, x_ptr, nw_ptr, k0, k, K, EVEN, PROLOGUE)
    out = tl.sum(acc, axis=1)
    if PROLOGUE == PROLOGUE_RMS_NORM:
        out = out * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    elif PROLOGUE == PROLOGUE_NORMED:
        out = out * tl.rsqrt(tl.sum(sq_parts, axis=0) / K + eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        # As the unfused layer: the product rounded to the output's dtype,
        # then the residual added in float32 and rounded again.
        res = tl.load(res_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32) + res
    if SILU_HALVES:
        # silu(gate) * up, each rounded to the output's dtype first, as
        # silu_and_mul reads and stores them.
        gate, up = tl.split(
            tl.reshape(out.to(out_ptr.dtype.element_ty).to(tl.float32), [BLOCK_N // 2, 2])
        )
        pairs = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + pairs, act.to(out_ptr.dtype.element_ty), mask=pairs < N // 2)
    else:
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + n, out, mask=n_mask)
    if NEXT_NORM:
        # The next RMS norm's input: the output (as stored) times the norm's
        # weight, rounded to the output's dtype, and the sum (float32) of its
        # squares over this program's rows (one part of the row's sum).
        stream = out.to(tl.float32)
        weight = tl.load(next_nw_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(xw_ptr + n, (stream * weight).to(xw_ptr.dtype.element_ty), mask=n_mask)
        tl.store(sq_out_ptr + pid, tl.sum(tl.where(n_mask, stream * stream, 0.0), axis=0))


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
    return dense_gemv_fused(x, weight, launch, bias)[0]


def dense_gemv_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    launch: GemvLaunch | None = None,
    bias: torch.Tensor | None = None,
    *,
    rms_norm_weight: torch.Tensor | None = None,
    sq_parts: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_pairs: bool = False,
    next_rms_norm_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, NormedRows | None]:
    """:func:`dense_gemv` with the fused decode's prologues and epilogues
    (:func:`~asyncstep.ops.triton.quant.q4_gemv_fused`'s, on one row): ``x``
    RMSNormed first with ``rms_norm_weight`` (its squares summed by each
    program), or ``x`` a :class:`~asyncstep.ops.triton.quant.NormedRows`'
    ``xw`` and ``sq_parts`` its parts (``[1, parts]``); the ``residual``
    ``[N]`` added (the product rounded first); ``silu_pairs``: the weight's
    rows are gate rows then up rows, the output ``silu(gate) * up``
    ``[N / 2]``; ``next_rms_norm_weight``: also the output's
    :class:`~asyncstep.ops.triton.quant.NormedRows` for the next GEMV.
    ``out_dtype``: the output's dtype (x's by default). Returns ``(out,
    normed or None)``."""
    _check(x, weight)
    n, k = weight.shape
    device = x.device
    if bias is not None and (
        tuple(bias.shape) != (n,) or not bias.is_floating_point() or bias.device != device
    ):
        raise ValueError(
            f"bias must be a float [{n}] on {device}, got {bias.dtype} "
            f"{tuple(bias.shape)} on {bias.device}"
        )
    prologue, nw, sq = PROLOGUE_NONE.value, weight, weight
    if rms_norm_weight is not None and sq_parts is not None:
        raise ValueError("one prologue at a time: rms_norm_weight or sq_parts")
    if rms_norm_weight is not None:
        _check_vector("rms_norm_weight", rms_norm_weight, k, device)
        prologue, nw = PROLOGUE_RMS_NORM.value, rms_norm_weight.contiguous()
    elif sq_parts is not None:
        if sq_parts.shape[:-1] not in ((), (1,)) or sq_parts.dtype != torch.float32:
            raise ValueError(
                f"sq_parts must be float32 (1, parts), got {sq_parts.dtype} {tuple(sq_parts.shape)}"
            )
        if sq_parts.device != device or sq_parts.stride(-1) != 1:
            raise ValueError("sq_parts must be on the weight's device, with unit last stride")
        prologue, sq = PROLOGUE_NORMED.value, sq_parts.reshape(-1)
    if silu_pairs and (residual is not None or next_rms_norm_weight is not None or n % 2):
        raise ValueError("silu_pairs takes an even row count, and no residual or next norm")
    dtype = out_dtype or x.dtype
    if dtype not in (torch.float32, *_DTYPES):
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    width = n // 2 if silu_pairs else n
    out = torch.empty(width, dtype=dtype, device=device)
    res = out
    if residual is not None:
        res = residual.reshape(-1)
        if res.shape != (n,) or res.dtype != dtype or res.device != device:
            raise ValueError(
                f"residual must be {dtype} ({n},) on {device}, got {residual.dtype} "
                f"{tuple(residual.shape)} on {residual.device}"
            )
        res = res.contiguous()
    cfg = launch or gemv_launch(n, k)
    if silu_pairs:  # a program's rows are pairs of rows: whole pairs
        cfg = cfg._replace(block_n=max(cfg.block_n, 2))
    normed, next_nw, xw, sq_out = None, out, out, out
    programs = triton.cdiv(width * 2 if silu_pairs else n, cfg.block_n)
    if next_rms_norm_weight is not None:
        _check_vector("next_rms_norm_weight", next_rms_norm_weight, n, device)
        next_nw = next_rms_norm_weight.contiguous()
        xw = torch.empty(n, dtype=dtype, device=device)
        sq_out = torch.empty(programs, dtype=torch.float32, device=device)
        normed = NormedRows(xw.reshape(*x.shape[:-1], n), sq_out.reshape(1, programs))
    x1 = x.reshape(k).contiguous()
    if n and k:
        _dense_gemv_kernel[(programs,)](
            x1,
            weight,
            bias.contiguous() if bias is not None else weight,  # any pointer: HAS_BIAS is off
            out,
            nw,
            sq,
            res,
            next_nw,
            xw,
            sq_out,
            n,
            k,
            weight.stride(0),
            sq.shape[0] if sq_parts is not None else 1,
            float(eps),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            EVEN=n % cfg.block_n == 0
            and k % cfg.block_k == 0
            and not (silu_pairs and (n // 2) % (cfg.block_n // 2)),
            HAS_BIAS=bias is not None,
            PROLOGUE=prologue,
            SQ_BLOCK=triton.next_power_of_2(sq.shape[0]) if sq_parts is not None else 1,
            RESIDUAL=residual is not None,
            SILU_HALVES=silu_pairs,
            NEXT_NORM=next_rms_norm_weight is not None,
            num_warps=cfg.num_warps,
            **pdl.launch_kwargs(x1),
        )
    elif bias is not None and not silu_pairs:
        out.copy_(bias)
    else:
        out.zero_()
    return out.reshape(*x.shape[:-1], width), normed


def _check_vector(name: str, v: torch.Tensor, size: int, device: torch.device) -> None:
    if v.shape != (size,) or not v.is_floating_point():
        raise ValueError(f"{name} must be a float ({size},), got {v.dtype} {tuple(v.shape)}")
    if v.device != device:
        raise ValueError(f"{name} on {v.device}, the weight on {device}")


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
