"""RMSNorm one program per row (issue 40): a row's sum of squares in an
order fixed by the hidden size alone, whatever the number of rows (torch's
reduction kernels pick their strategy from the whole tensor's shape).

:func:`rms_norm` is ``F.rms_norm(x, weight, eps)`` in float32, rounded once
to x's dtype, as :func:`~asyncstep.ops.triton.fused.fused_add_rms_norm`
normalises (which is one program per row too, and batch-invariant as it
is). Launch from shapes only: CUDA-graph safe.

May import torch, triton and :mod:`asyncstep.ops.triton.fused`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton.fused import _MAX_BLOCK, _check_rows, _num_warps

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * n_cols + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x ``[..., hidden]`` (rows may be strided, unit last stride)
    times weight ``[hidden]`` (any float dtype): a new contiguous tensor of
    x's dtype. ValueError for shapes, dtypes or devices that do not fit."""
    hidden = x.shape[-1] if x.dim() else 0
    x2 = x.reshape(-1, hidden)
    _check_rows("x", x2)
    if weight.shape != (hidden,) or (hidden > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be contiguous ({hidden},), got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")
    block = triton.next_power_of_2(hidden)
    if block > _MAX_BLOCK:
        raise ValueError(f"hidden size {hidden} too large (at most {_MAX_BLOCK})")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and hidden:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            x2.stride(0),
            hidden,
            float(eps),
            BLOCK=block,
            num_warps=_num_warps(block),
        )
    return out.view(x.shape)
