"""The batch-invariant matmul's prompt launch with TMA loads (issue 40).

:func:`prompt_matmul` computes ``x @ w.T`` (x ``[M, K]``, w ``[N, K]``,
16-bit, rows contiguous and 16-byte aligned: :func:`tma_fits`) with the
sums of :func:`~asyncstep.ops.triton.invariant_matmul.invariant_matmul`'s
program-per-tile launch: an element's K cut into the same splits, a split's
BLOCK_K chunks chained through ``tl.dot`` into a float32 partial from zero,
the partials added in split order from zero, rounded once. Only how the
data moves differs: the tiles come by TMA (rows, columns and features past
the tensor read as zeros, as the masked loads do) and a fixed number of
persistent programs walk the output tiles, GROUP_M row tiles at a time
(each weight tile read while it is in L2). Which program computes a tile
never changes its sums: the bits are the tile launch's (tested on CUDA,
and against the pointer kernel under the interpreter).

May import torch, triton and :mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior

__all__ = ["GROUP_M", "prompt_matmul", "tma_fits"]

#: Row tiles a group of persistent programs walks before the next columns.
GROUP_M = 8


def tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether TMA can load every 2-D tensor of ``tensors``: Hopper or later
    on CUDA (any device under the interpreter), 16-bit, the last dimension
    contiguous, the base and the row stride 16-byte aligned."""
    for t in tensors:
        if t.device.type == "cuda" and _capability(t.device) < 9:
            return False
        if t.dim() != 2 or t.element_size() != 2 or t.stride(1) != 1:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * 2) % 16:
            return False
    return True


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@triton.jit(do_not_specialize=["M", "PROGRAMS"])
def _prompt_matmul_kernel(
    x_desc: tl.tensor,
    w_desc: tl.tensor,
    out_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    K_SPLIT: tl.tensor,
    PROGRAMS: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """Grid ``(PROGRAMS,)``: program p computes output tiles p, p +
    PROGRAMS, ... (grouped ``GROUP`` row tiles at a time), each the sum of
    its splits' partials in split order from zero."""
    launch_dependents(PDL)
    wait_prior(PDL)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP * tiles_n
    for tile in range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS):
        first_m = (tile // per_group) * GROUP
        group_m = tl.minimum(tiles_m - first_m, GROUP)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k_start in range(0, K, K_SPLIT):
            part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
                x = x_desc.load([off_m, k0])
                w = w_desc.load([off_n, k0])
                part = tl.dot(x, w.T, part)
            total += part
        rows = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        cols = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


def prompt_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    k_split: int,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    programs: int,
) -> None:
    """``out[:] = x @ weight.T`` (:func:`tma_fits` both) summed in splits of
    ``k_split`` features (a multiple of ``block_k``) by at most ``programs``
    persistent programs."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = max(1, min(programs, tiles))
    _prompt_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        out,
        m,
        n,
        k,
        k_split,
        programs,
        *out.stride(),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP=GROUP_M,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_kwargs(x),
    )
