"""Fused Triton kernels for the decoder layer's elementwise work.

``fused_add_rms_norm``: the residual add and RMSNorm in one kernel (one read
of ``x`` and ``residual``, one write of each output), equal to
``RMSNorm.forward_residual`` in ``asyncstep.models.layers.norm``.

``qk_rms_norm``: Qwen3's (and Gemma 3's) per-head RMSNorms of q and k in
one kernel, a program a token (torch's ``rms_norm`` takes a launch each).

``silu_and_mul``: the gated MLP activation, ``silu(gate) * up`` of a
``gate_up_proj`` output ``[tokens, 2 * d]``, in one kernel (the torch version
is three: silu, the product, and the copy of the strided halves).

The rotary embedding's kernels (``rotary_embedding``, ``rotary_and_store_kv``)
are in :mod:`asyncstep.ops.triton.rotary`.

All do their math in float32, launch with programmatic dependent launch
where the GPU has it (:mod:`asyncstep.ops.triton.pdl`: a program lets the
next kernel launch, then waits for the kernel before; the add + RMSNorm
loads its weight before it waits), take strided rows (unit last stride: q and k
may be column slices of a fused qkv output), compute their launch grid from
shapes only (no host sync: safe to capture in a CUDA graph once warmed up, the
first call of a new specialization compiles), and raise ``ValueError`` for
mismatched shapes, dtypes or devices. On the CPU they run under the Triton
interpreter (``TRITON_INTERPRET=1``), which the tests use.

May import torch, triton and :mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.pdl import launch_dependents, launch_then_wait, wait_prior

__all__ = [
    "fused_add_rms_norm",
    "qk_rms_norm",
    "silu_and_mul",
]

#: Widest row one program handles (elements): a row lives in registers.
_MAX_BLOCK = 65536

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _fused_add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    res_ptr,
    weight_ptr,
    out_ptr,
    res_out_ptr,
    x_row_stride,
    res_row_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # nobody's output
    wait_prior(PDL)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # The residual is stored in the activation dtype and normalised as stored,
    # as the torch version does (a no-op round trip in float32).
    summed = (x + res).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * n_cols + cols, summed, mask=mask)
    r = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(r * r, axis=0) / n_cols + eps)
    tl.store(
        out_ptr + row * n_cols + cols, (r * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit last stride, got strides {t.stride()}")


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 8)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, residual_out)``: ``residual_out = residual + x`` (computed in
    float32, stored in x's dtype), ``out = rms_norm(residual_out) * weight``
    (in float32, rounded once to x's dtype).

    x, residual: [tokens, hidden] of one dtype, rows may be strided (unit last
    stride); weight: [hidden], any float dtype. Both outputs are new contiguous
    tensors; the inputs are not modified.
    """
    _check_rows("x", x)
    _check_rows("residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} != x dtype {x.dtype}")
    hidden = x.shape[1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    if weight.dtype not in _FLOAT_DTYPES or (hidden > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be a contiguous float tensor, got {weight.dtype}")
    if not x.device == residual.device == weight.device:
        raise ValueError(
            f"x, residual and weight on different devices: "
            f"{x.device}, {residual.device}, {weight.device}"
        )
    block = triton.next_power_of_2(hidden)
    if block > _MAX_BLOCK:
        raise ValueError(f"hidden size {hidden} too large (at most {_MAX_BLOCK})")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens = x.shape[0]
    if tokens == 0 or hidden == 0:
        return out, residual_out
    _fused_add_rms_norm_kernel[(tokens,)](
        x,
        residual,
        weight,
        out,
        residual_out,
        x.stride(0),
        residual.stride(0),
        hidden,
        float(eps),
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl.launch_kwargs(x),
    )
    return out, residual_out


@triton.jit
def _norm_heads(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, out_ptr, row, row_stride, heads, head_dim, eps, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row ``row``'s heads (each ``head_dim`` features) RMSNormed in float32
    with weight ``w [head_dim]``, rounded once into the contiguous out."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < head_dim)
    x = tl.load(x_ptr + row * row_stride + h * head_dim + d, mask=mask, other=0.0)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / head_dim + eps)
    w = tl.load(w_ptr + d, mask=d < head_dim, other=0.0).to(tl.float32)
    y = x * inv_rms[:, None] * w
    out = out_ptr + row * heads * head_dim + h * head_dim + d
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_rms_norm_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_out_ptr,
    q_row_stride,
    k_row_stride,
    q_heads,
    k_heads,
    head_dim,
    eps,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid ``(tokens,)``: the token's q heads, then its k heads."""
    launch_then_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    _norm_heads(
        q_ptr, q_weight_ptr, q_out_ptr, row, q_row_stride, q_heads, head_dim, eps, BLOCK_HQ,
        BLOCK_D,
    )  # fmt: skip
    _norm_heads(
        k_ptr, k_weight_ptr, k_out_ptr, row, k_row_stride, k_heads, head_dim, eps, BLOCK_HK,
        BLOCK_D,
    )  # fmt: skip


def qk_rms_norm(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(q_out, k_out)``: each head of ``q [tokens, Hq * D]`` and
    ``k [tokens, Hk * D]`` (one dtype; rows may be strided, unit last
    stride: column slices of a fused qkv output) RMSNormed over its D
    features with ``q_weight`` / ``k_weight`` ``[D]`` (any float dtype), in
    float32, rounded once to q's dtype; new contiguous tensors of q's and
    k's shapes. The same as ``rms_norm`` of each viewed ``[tokens, H, D]``."""
    _check_rows("q", q)
    _check_rows("k", k)
    head_dim = q_weight.shape[0] if q_weight.dim() == 1 else 0
    if (
        head_dim == 0
        or k_weight.shape != (head_dim,)
        or q.shape[1] % head_dim
        or k.shape[1] % head_dim
    ):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be whole heads of the weights' "
            f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)} features"
        )
    if k.dtype != q.dtype or k.shape[0] != q.shape[0]:
        raise ValueError(
            f"k {k.dtype} {tuple(k.shape)} does not match q {q.dtype} {tuple(q.shape)}"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.dtype not in _FLOAT_DTYPES or (head_dim > 1 and w.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous float tensor, got {w.dtype}")
    if not q.device == k.device == q_weight.device == k_weight.device:
        raise ValueError("q, k and their weights must be on one device")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_heads, k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    block = triton.next_power_of_2(max(q_heads, k_heads, 1) * head_dim)
    if q.shape[0] == 0 or block > _MAX_BLOCK:
        if q.shape[0] == 0:
            return q_out, k_out
        raise ValueError(f"{q_heads} heads of {head_dim} too large (at most {_MAX_BLOCK})")
    _qk_rms_norm_kernel[(q.shape[0],)](
        q,
        k,
        q_weight,
        k_weight,
        q_out,
        k_out,
        q.stride(0),
        k.stride(0),
        q_heads,
        k_heads,
        head_dim,
        float(eps),
        BLOCK_HQ=triton.next_power_of_2(q_heads),
        BLOCK_HK=triton.next_power_of_2(k_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=_num_warps(block),
        **pdl.launch_kwargs(q),
    )
    return q_out, k_out


# -- silu_and_mul ------------------------------------------------------------------

#: Columns of the output one silu_and_mul program writes (a row wider than this
#: is split over several programs, so one decode token still fills the GPU).
_SILU_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    x_row_stride,
    d,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    launch_then_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g), written as torch computes it: g / (1 + exp(-g)).
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * d + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Return ``silu(gate) * up`` for ``gate, up = x.chunk(2, -1)``.

    x: [tokens, 2 * d] of a float dtype (gate in the first half of each row, up
    in the second), rows may be strided (unit last stride). The result is a new
    contiguous [tokens, d] tensor of x's dtype, computed in float32 and rounded
    once (torch in bfloat16 rounds after the silu and again after the product).
    """
    _check_rows("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x width {x.shape[1]} is odd: expected [tokens, 2 * d]")
    tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, d), dtype=x.dtype, device=x.device)
    if tokens == 0 or d == 0:
        return out
    block = min(triton.next_power_of_2(d), _SILU_BLOCK)
    _silu_and_mul_kernel[(tokens, triton.cdiv(d, block))](
        x, out, x.stride(0), d, BLOCK=block, num_warps=_num_warps(block), **pdl.launch_kwargs(x)
    )
    return out
