"""Weights kept 4-bit (or 8-bit) on the GPU: GGUF's Q4_0 / Q4_1 (Q8_0)
blocks as packed codes with per-block scales, and the Triton kernels that
multiply by them without a dense copy.

The layouts (``Q4``, ``Q8``: :mod:`asyncstep.ops.triton.quant_layout`, whose
names are re-exported here) keep an ``[N, K]`` weight's codes in blocks
of :data:`GROUP_SIZE` input features with a float16 scale and offset a
block; the kernels live in :mod:`asyncstep.ops.triton.quant_kernels`.

:func:`q4_matmul` is ``x @ w.T`` for ``x`` ``[..., K]`` (float32, float16 or
bfloat16), in ``x``'s dtype, by the size of the step:

- up to :data:`GEMV_MAX_M` rows, :func:`q4_gemv`: each program streams the
  packed words of a few output rows once, for every row of ``x``, and
  accumulates ``d * sum(q x) + m * sum(x)`` per block in float32 (the
  dequantized weight is never formed; a code, masked in place, is read as a
  subnormal float32, and ``x`` is scaled by a power of two to match: the
  products are exact for ``|x| < 2**40``, and entries below ``2**-60`` in
  magnitude may lose bits); with ``int8_x`` (opt-in: the config's
  ``gpu_q4_activations="int8"``) a 16-bit ``x`` is instead quantized per
  block of 32 to int8 and multiplied by integer dot products
  (:mod:`asyncstep.ops.triton.quant_packed`: not the float products'
  numerics); launched with PDL (:mod:`asyncstep.ops.triton.pdl`) where the
  GPU has it;
- up to :data:`DOT_MAX_M` rows, :func:`q4_dot`: a tiled GEMM that
  dequantizes each weight tile in registers to ``x``'s dtype and multiplies
  on the tensor cores (float32 accumulation; a float32 ``x`` multiplies in
  IEEE float32);
- above, :func:`dequantize_q4` to ``x``'s dtype, then ``torch``'s matmul (a
  large step is bound by its arithmetic, and the dequantized copy is
  temporary).

:func:`q8_gemv` is the GEMV for the 8-bit layout and :func:`q8_matmul` its
dispatch (the GEMV up to :data:`GEMV_MAX_M` rows, else dequantize and
matmul).

Every launcher computes its grid from shapes only and allocates with torch
(no host sync: capturable in a CUDA graph once warmed up; the first call of
a new specialization compiles) and raises ``ValueError`` for mismatched
shapes, dtypes or devices. On the CPU the kernels run under the Triton
interpreter (``TRITON_INTERPRET=1``), which the tests use.

May import torch, triton and its sibling modules quant_layout, quant_kernels and pdl.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.quant_kernels import (
    PROLOGUE_NONE,
    PROLOGUE_NORMED,
    PROLOGUE_RMS_NORM,
    _gemv_kernel,
    _q4_dequant_kernel,
    _q4_dot_kernel,
)
from asyncstep.ops.triton.quant_layout import (
    GROUP_SIZE,
    _check_weight,
    dequantize_q4_reference,
    dequantize_q8_reference,
    interleave_pairs,
    pack_q4,
    pack_q8,
)

__all__ = [
    "DOT_MAX_M",
    "GEMV_MAX_M",
    "GROUP_SIZE",
    "GemvConfig",
    "NormedRows",
    "dequantize_q4",
    "dequantize_q4_reference",
    "dequantize_q8_reference",
    "interleave_pairs",
    "pack_q4",
    "pack_q8",
    "q4_dot",
    "q4_gemv",
    "q4_gemv_fused",
    "q4_matmul",
    "q8_gemv",
    "q8_matmul",
]

#: Steps of at most this many rows take :func:`q4_gemv`; a model keeps its
#: dense weight for larger steps (why: ``benchmarks/studies/decode_kernels/README.md``).
GEMV_MAX_M = 1
#: ... and up to this many :func:`q4_dot`; larger ones dequantize and matmul.
DOT_MAX_M = 128

#: Kernels run under the Triton interpreter (no inline PTX there).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class GemvConfig(NamedTuple):
    """A launch of :func:`q4_gemv`: output rows per program, blocks of 32
    features per loop step, warps, whether each loop step loads the next
    step's words before it computes (double buffering in registers), and the
    loop's pipeline depth (Triton's ``num_stages``: above 1, the loads of
    later steps go to shared memory ahead, by asynchronous copies), and
    whether x is quantized per block to int8 and multiplied by ``dp4a``
    (:mod:`asyncstep.ops.triton.quant_packed`; else the exact float32 products)."""

    block_n: int = 8
    block_g: int = 32
    num_warps: int = 4
    prefetch: bool = True
    stages: int = 1
    int8: bool = False


def _check_x(x: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    """``x`` as ``[M, K]`` rows (a view where it can be)."""
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x's last dimension must be the weight's K ({k}), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"x on {x.device}, the weight on {device}")
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


# -- launchers ---------------------------------------------------------------


def _empty_out(x2: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x2.device)


def _gemv_config(n: int, groups: int, bits: int, *, int8: bool, pdl_on: bool) -> GemvConfig:
    """The launch for an ``[n, 32 groups]`` weight of ``bits``-bit codes
    (picked on llama-8b's shapes, ``benchmarks/studies/decode_kernels/README.md``
    and ``benchmarks/studies/q4_packed/README.md``): two warps whose lanes go
    along a row's blocks, 64 blocks a loop step, 8 rows a thread (4-bit) or
    32 blocks (8-bit); a long row (>= 256 blocks), or with PDL (``pdl_on``:
    the first step's words load before the kernel waits for x) a 4-bit
    weight of fewer than 16384 rows (one wave of programs), loads the next
    step's words ahead. ``int8``: x quantized per block to int8."""
    if bits == 8:
        return GemvConfig(block_n=8, block_g=32, num_warps=2, prefetch=False, int8=int8)
    prefetch = groups >= 256 or (pdl_on and n < 16384)
    return GemvConfig(block_n=8, block_g=64, num_warps=2, prefetch=prefetch, int8=int8)


class NormedRows(NamedTuple):
    """Rows made ready, by the kernel that wrote them, for an RMS norm folded
    into the next GEMV (:func:`q4_gemv_fused`'s ``next_rms_norm_weight``):
    ``xw`` (``[M, K]``, the rows' dtype) the rows times the norm's weight, and
    ``sq_parts`` (float32 ``[M, parts]``) the sums of the rows' squares over
    parts of the features (the row's sum of squares is their sum)."""

    xw: torch.Tensor
    sq_parts: torch.Tensor


def _gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    config: GemvConfig | None,
    *,
    rms_norm_weight: torch.Tensor | None = None,
    sq_parts: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_pairs: bool = False,
    next_rms_norm_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    int8_x: bool = False,
) -> tuple[torch.Tensor, NormedRows | None]:
    n, groups = _check_weight(qweight, scales, bits)
    x2 = _check_x(x, groups * GROUP_SIZE, qweight.device)
    rows = x2.shape[0]
    prologue, nw, sq = PROLOGUE_NONE.value, x2, x2
    if rms_norm_weight is not None and sq_parts is not None:
        raise ValueError("one prologue at a time: rms_norm_weight or sq_parts")
    if rms_norm_weight is not None:
        _check_vector("rms_norm_weight", rms_norm_weight, x2.shape[1], qweight.device)
        prologue, nw = PROLOGUE_RMS_NORM.value, rms_norm_weight.contiguous()
    elif sq_parts is not None:
        if sq_parts.dim() != 2 or sq_parts.shape[0] != rows or sq_parts.dtype != torch.float32:
            raise ValueError(
                f"sq_parts must be float32 ({rows}, parts), got {sq_parts.dtype} "
                f"{tuple(sq_parts.shape)}"
            )
        if sq_parts.device != qweight.device or sq_parts.stride(-1) != 1:
            raise ValueError("sq_parts must be on the weight's device, with unit last stride")
        prologue, sq = PROLOGUE_NORMED.value, sq_parts
    if silu_pairs and (residual is not None or next_rms_norm_weight is not None or n % 2):
        raise ValueError("silu_pairs takes an even row count, and no residual or next norm")
    if out_dtype is not None and out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    dtype = out_dtype or x2.dtype
    out = torch.empty((rows, n // 2 if silu_pairs else n), dtype=dtype, device=x2.device)
    res = out
    if residual is not None:
        res = residual.reshape(-1, n) if residual.numel() == out.numel() else residual
        if res.shape != out.shape or res.dtype != dtype or res.device != out.device:
            raise ValueError(
                f"residual must be {dtype} {tuple(out.shape)} on {out.device}, got "
                f"{res.dtype} {tuple(res.shape)} on {res.device}"
            )
        if n > 1 and res.stride(1) != 1:
            res = res.contiguous()
    launch_pdl = pdl.launch_kwargs(x2)
    int8 = int8_x and x2.dtype != torch.float32
    cfg = config or _gemv_config(n, groups, bits, int8=int8, pdl_on=launch_pdl["PDL"])
    normed = None
    next_nw = xw = sq_out = out
    if next_rms_norm_weight is not None:
        _check_vector("next_rms_norm_weight", next_rms_norm_weight, n, qweight.device)
        next_nw = next_rms_norm_weight.contiguous()
        xw = torch.empty((rows, n), dtype=dtype, device=x2.device)
        sq_out = torch.empty(
            (rows, triton.cdiv(n, cfg.block_n)), dtype=torch.float32, device=x2.device
        )
        normed = NormedRows(xw.reshape(*x.shape[:-1], n), sq_out)
    if rows and n:
        block_m = min(triton.next_power_of_2(rows), 4)
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(rows, block_m))
        _gemv_kernel[grid](
            x2,
            qweight.view(torch.int32),
            scales.view(torch.int32),
            out,
            nw,
            sq,
            res,
            next_nw,
            xw,
            sq_out,
            rows,
            n,
            groups,
            x2.stride(0),
            out.stride(0),
            sq.stride(0),
            res.stride(0),
            xw.stride(0),
            sq_out.stride(0),
            sq.shape[1],
            float(eps),
            BITS=bits,
            BLOCK_M=block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_G=cfg.block_g,
            PREFETCH=cfg.prefetch,
            EVEN=n % cfg.block_n == 0 and groups % cfg.block_g == 0,
            STAGES=cfg.stages,
            PROLOGUE=prologue,
            SQ_BLOCK=triton.next_power_of_2(sq.shape[1]) if sq_parts is not None else 1,
            RESIDUAL=residual is not None,
            SILU_PAIRS=silu_pairs,
            NEXT_NORM=next_rms_norm_weight is not None,
            INT8=cfg.int8,
            ASM=x2.is_cuda and not _INTERPRETED,
            num_warps=cfg.num_warps,
            **launch_pdl,
        )
    return out.reshape(*x.shape[:-1], out.shape[1]), normed


def _check_vector(name: str, v: torch.Tensor, size: int, device: torch.device) -> None:
    if v.shape != (size,) or v.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a float ({size},), got {v.dtype} {tuple(v.shape)}")
    if v.device != device:
        raise ValueError(f"{name} on {v.device}, the weight on {device}")


def q4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    int8_x: bool = False,
) -> torch.Tensor:
    """``x @ w.T`` by streaming the packed 4-bit weight (see the module's
    docstring); any number of rows, meant for a few (a program unrolls up to
    4 rows of ``x`` over one read of its weights). ``int8_x``: a 16-bit
    ``x`` quantized per block of 32 to int8 (``config``, where given, says
    instead)."""
    return _gemv(x, qweight, scales, 4, config, int8_x=int8_x)[0]


def q4_gemv_fused(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    rms_norm_weight: torch.Tensor | None = None,
    sq_parts: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    silu_pairs: bool = False,
    next_rms_norm_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
    int8_x: bool = False,
) -> tuple[torch.Tensor, NormedRows | None]:
    """:func:`q4_gemv` with the fused decode's prologue and epilogues (the
    decoder layer's elementwise kernels folded in). Returns ``(out,
    normed)``: ``normed`` the :class:`NormedRows` of ``out`` with
    ``next_rms_norm_weight``, else None.

    Prologue, at most one:

    - ``rms_norm_weight``: ``rms_norm(x, eps) * rms_norm_weight`` in place of
      ``x``: each program sums the squares of the row it reads and scales its
      dot products by the norm's ``1 / rms``;
    - ``sq_parts``: ``x`` is a :class:`NormedRows`' ``xw`` and this its
      ``sq_parts``: the same, without the per-element work.

    The unfused norm rounds ``rms_norm(x) * weight`` to x's dtype; here
    ``x * weight`` is rounded (``xw``) or not at all (``rms_norm_weight``).
    ``out_dtype``: the output's dtype (default x's).

    Epilogues:

    - ``residual`` (x's dtype, the output's shape): ``out = residual +
      product``, the product rounded to x's dtype first, then the sum (the
      unfused layer's add: the new residual stream);
    - ``silu_pairs``: the weight's rows are gate and up rows interleaved
      (:func:`interleave_pairs`): ``out[:, j] = silu(gate_j) * up_j``
      (``[M, N / 2]``), each rounded as :func:`asyncstep.ops.triton.fused.silu_and_mul`
      reads and stores them;
    - ``next_rms_norm_weight`` (``[N]``): also the :class:`NormedRows` of
      ``out`` for the RMS norm of that weight, which the next GEMV folds in
      with ``sq_parts``.

    ``int8_x``: as :func:`q4_gemv`'s; the prologues then quantize ``x *
    weight`` (the norm's ``1 / rms`` scales the dot products after).
    """
    return _gemv(
        x,
        qweight,
        scales,
        4,
        config,
        rms_norm_weight=rms_norm_weight,
        sq_parts=sq_parts,
        eps=eps,
        residual=residual,
        silu_pairs=silu_pairs,
        next_rms_norm_weight=next_rms_norm_weight,
        out_dtype=out_dtype,
        int8_x=int8_x,
    )


def q8_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    int8_x: bool = False,
) -> torch.Tensor:
    """:func:`q4_gemv` for the 8-bit layout."""
    return _gemv(x, qweight, scales, 8, config, int8_x=int8_x)[0]


def q4_dot(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_g: int = 4,
    num_warps: int = 4,
    num_stages: int = 3,
    magic: bool = True,
    swap: bool = True,
) -> torch.Tensor:
    """``x @ w.T`` by a tiled GEMM that dequantizes each weight tile in
    registers (see the module's docstring). ``block_m``: rows of ``x`` per
    tile (default: ``M`` rounded up to a power of two, 16 to 64);
    ``swap``: the weight tile is the MMA's first operand (``out.T = w x.T``,
    which suits few rows)."""
    n, groups = _check_weight(qweight, scales)
    x2 = _check_x(x, groups * GROUP_SIZE, qweight.device)
    out = _empty_out(x2, n)
    rows = x2.shape[0]
    if rows and n:
        bm = block_m or min(max(triton.next_power_of_2(rows), 16), 64)
        grid = (triton.cdiv(n, block_n), triton.cdiv(rows, bm))
        _q4_dot_kernel[grid](
            x2,
            qweight.view(torch.int32),
            scales.view(torch.int32),
            out,
            rows,
            n,
            groups,
            x2.stride(0),
            out.stride(0),
            BLOCK_M=bm,
            BLOCK_N=block_n,
            BLOCK_G=block_g,
            MAGIC=magic,
            SWAP=swap,
            IEEE=x2.dtype == torch.float32,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return out.reshape(*x.shape[:-1], n)


def dequantize_q4(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight in ``dtype`` (computed in float32, rounded once)."""
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    n, groups = _check_weight(qweight, scales)
    out = torch.empty((n, groups * GROUP_SIZE), dtype=dtype, device=qweight.device)
    if n and groups:
        block_n, block_g = 8, 4
        grid = (triton.cdiv(n, block_n), triton.cdiv(groups, block_g))
        _q4_dequant_kernel[grid](
            qweight.view(torch.int32),
            scales.view(torch.int32),
            out,
            n,
            groups,
            BLOCK_N=block_n,
            BLOCK_G=block_g,
            num_warps=4,
        )
    return out


def q4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    int8_x: bool = False,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in ``x``'s dtype, by the path that suits the
    number of rows (see the module's docstring; ``int8_x``: the GEMV's)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows <= GEMV_MAX_M:
        y = q4_gemv(x, qweight, scales, int8_x=int8_x)
    elif rows <= DOT_MAX_M:
        y = q4_dot(x, qweight, scales)
    else:
        _check_x(x, qweight.shape[1] * 2, qweight.device)
        return F.linear(x, dequantize_q4(qweight, scales, x.dtype), bias)
    return y if bias is None else y + bias


def q8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    int8_x: bool = False,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for the 8-bit layout, in ``x``'s dtype: the GEMV
    up to :data:`GEMV_MAX_M` rows (``int8_x``: its), else the weight
    dequantized (torch ops) and ``torch``'s matmul."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows <= GEMV_MAX_M:
        y = q8_gemv(x, qweight, scales, int8_x=int8_x)
        return y if bias is None else y + bias
    _check_weight(qweight, scales, 8)
    _check_x(x, qweight.shape[1], qweight.device)
    return F.linear(x, dequantize_q8_reference(qweight, scales).to(x.dtype), bias)
