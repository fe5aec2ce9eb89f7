"""Rotary-embedding Triton kernels of the decoder layer.

``rotary_embedding``: neox-style rotary embedding of q and k, in place, equal
to ``RotaryEmbedding`` in ``asyncstep.models.layers.rotary`` (here with the
cos/sin kept in float32).

``rotary_and_store_kv``: ``rotary_embedding`` and the paged KV-cache write of
``asyncstep.ops.triton.attention.store_kv_cache`` in one kernel: q and k are
rotated in place and the rotated k and v go to each token's cache slot.

The contract of :mod:`asyncstep.ops.triton.fused`'s kernels holds here too:
float32 math, strided rows (unit last stride), grids from shapes only (CUDA
graph safe), ``ValueError`` for mismatched shapes, dtypes or devices; on the
CPU under the Triton interpreter.

``rotary_and_store_kv`` launches with programmatic dependent launch where
the GPU has it (:mod:`asyncstep.ops.triton.pdl`).

May import torch, triton, :mod:`asyncstep.ops.triton.fused` (its row
checks and launch widths) and :mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.fused import _check_rows, _num_warps
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior

__all__ = ["rotary_and_store_kv", "rotary_embedding"]


@triton.jit
def _cos_sin(  # type: ignore[no-untyped-def]
    positions_ptr, cache_ptr, cache_row_stride, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr
):
    """This program's token's cos and sin (``[1, HALF_BLOCK]``, float32) and
    the mask of the real half dimensions."""
    pos = tl.load(positions_ptr + tl.program_id(0).to(tl.int64)).to(tl.int64)
    dims = tl.arange(0, HALF_BLOCK)[None, :]
    dim_mask = dims < HALF
    cache_row = cache_ptr + pos * cache_row_stride
    cos = tl.load(cache_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    return cos, sin, dim_mask


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]
    x_ptr,
    row_stride,
    cos,
    sin,
    dim_mask,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    """Rotates all heads of one token's row in place (cos/sin: [1, HALF_BLOCK])."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_BLOCK)[:, None]
    dims = tl.arange(0, HALF_BLOCK)[None, :]
    mask = (heads < num_heads) & dim_mask
    ptr1 = x_ptr + row * row_stride + heads * HEAD_DIM + dims
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_row_stride,
    k_row_stride,
    cache_row_stride,
    num_q_heads,
    num_k_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_BLOCK: tl.constexpr,
    K_HEADS_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
):
    cos, sin, dim_mask = _cos_sin(positions_ptr, cache_ptr, cache_row_stride, HALF, HALF_BLOCK)
    _rotate_heads(
        q_ptr,
        q_row_stride,
        cos,
        sin,
        dim_mask,
        num_q_heads,
        HEAD_DIM,
        HALF,
        Q_HEADS_BLOCK,
        HALF_BLOCK,
    )
    _rotate_heads(
        k_ptr,
        k_row_stride,
        cos,
        sin,
        dim_mask,
        num_k_heads,
        HEAD_DIM,
        HALF,
        K_HEADS_BLOCK,
        HALF_BLOCK,
    )


def _check_rotary_args(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> None:
    """Raise ValueError for arguments rotary_embedding cannot take."""
    _check_rows("q", q)
    _check_rows("k", k)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} != q dtype {q.dtype}")
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be positive and even, got {head_dim}")
    tokens = q.shape[0]
    if positions.shape != (tokens,) or k.shape[0] != tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)}, q {tuple(q.shape)} and k {tuple(k.shape)} "
            "disagree on the number of tokens"
        )
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 or int32, got {positions.dtype}")
    for name, t in (("q", q), ("k", k)):
        if t.shape[1] % head_dim:
            raise ValueError(f"{name} width {t.shape[1]} is not a multiple of head_dim {head_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_pos, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"cos_sin_cache must be float32 with unit last stride, got {cos_sin_cache.dtype}"
        )
    if not positions.device == q.device == k.device == cos_sin_cache.device:
        raise ValueError(
            f"positions, q, k and cos_sin_cache on different devices: {positions.device}, "
            f"{q.device}, {k.device}, {cos_sin_cache.device}"
        )


def _head_blocks(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> dict[str, int]:
    """The rotary kernels' block sizes and warps for q's and k's heads."""
    q_heads_block = triton.next_power_of_2(max(q.shape[1] // head_dim, 1))
    half_block = triton.next_power_of_2(head_dim // 2)
    return {
        "HEAD_DIM": head_dim,
        "HALF": head_dim // 2,
        "Q_HEADS_BLOCK": q_heads_block,
        "K_HEADS_BLOCK": triton.next_power_of_2(max(k.shape[1] // head_dim, 1)),
        "HALF_BLOCK": half_block,
        "num_warps": _num_warps(q_heads_block * half_block),
    }


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k **in place** (neox style) and return them, ``(q, k)``.

    q: [tokens, num_heads * head_dim], k: [tokens, num_kv_heads * head_dim], of
    one float dtype; rows may be strided (unit last stride), so both may be
    column slices of a fused qkv output, which is then rotated in place.
    positions: int64 (or int32) [tokens]; cos_sin_cache: float32
    [max_pos, head_dim], cos in the first half, sin in the second. The math is
    in float32 (cos/sin are not rounded to q's dtype first). Positions are not
    range-checked (that would need a host sync): each must be < max_pos.
    """
    _check_rotary_args(positions, q, k, cos_sin_cache, head_dim)
    tokens = q.shape[0]
    if tokens == 0:
        return q, k
    _rotary_kernel[(tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        k.stride(0),
        cos_sin_cache.stride(0),
        q.shape[1] // head_dim,
        k.shape[1] // head_dim,
        **_head_blocks(q, k, head_dim),
    )
    return q, k


# -- rotary_and_store_kv -------------------------------------------------------------


@triton.jit
def _rotary_store_kv_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    kv_ptr,
    slot_ptr,
    q_row_stride,
    k_row_stride,
    v_row_stride,
    cos_sin_row_stride,
    stride_c,
    stride_ch,
    stride_cb,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_BLOCK: tl.constexpr,
    K_HEADS_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per token: rotates its q and k rows in place and copies the
    rotated k and its v to the token's cache slot (none for slot < 0)."""
    launch_dependents(PDL)
    wait_prior(PDL)  # the qkv projection may still be writing q, k and v
    row = tl.program_id(0).to(tl.int64)
    cos, sin, dim_mask = _cos_sin(positions_ptr, cos_sin_ptr, cos_sin_row_stride, HALF, HALF_BLOCK)
    dims = tl.arange(0, HALF_BLOCK)[None, :]
    _rotate_heads(
        q_ptr,
        q_row_stride,
        cos,
        sin,
        dim_mask,
        num_q_heads,
        HEAD_DIM,
        HALF,
        Q_HEADS_BLOCK,
        HALF_BLOCK,
    )
    # k: as _rotate_heads, keeping the rotated halves for the cache.
    heads = tl.arange(0, K_HEADS_BLOCK).to(tl.int64)[:, None]
    mask = (heads < num_kv_heads) & dim_mask
    k1_ptr = k_ptr + row * k_row_stride + heads * HEAD_DIM + dims
    k1 = tl.load(k1_ptr, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(k1_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty)
    out2 = (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
    tl.store(k1_ptr, out1, mask=mask)
    tl.store(k1_ptr + HALF, out2, mask=mask)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = kv_ptr + block * stride_cb + offset * stride_cs + heads * stride_ch + dims
        tl.store(dst, out1, mask=mask)
        tl.store(dst + HALF, out2, mask=mask)
        v1_ptr = v_ptr + row * v_row_stride + heads * HEAD_DIM + dims
        tl.store(dst + stride_c, tl.load(v1_ptr, mask=mask), mask=mask)
        tl.store(dst + stride_c + HALF, tl.load(v1_ptr + HALF, mask=mask), mask=mask)


def _check_store_args(
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError for a v, kv_cache or slot_mapping that does not fit k."""
    _check_rows("v", v)
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if v.dtype != k.dtype:
        raise ValueError(f"v dtype {v.dtype} != k dtype {k.dtype}")
    num_kv_heads = k.shape[1] // head_dim
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or kv_cache.shape[1] != num_kv_heads
        or kv_cache.shape[4] != head_dim
    ):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not "
            f"[2, {num_kv_heads}, blocks, block_size, {head_dim}]"
        )
    if kv_cache.dtype != k.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != k dtype {k.dtype}")
    if kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache must have unit last stride, got strides {kv_cache.stride()}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be 1-D int64, got {slot_mapping.dtype} "
            f"of shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.shape[0] < k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens"
        )
    if not k.device == v.device == kv_cache.device == slot_mapping.device:
        raise ValueError(
            f"k, v, kv_cache and slot_mapping on different devices: {k.device}, {v.device}, "
            f"{kv_cache.device}, {slot_mapping.device}"
        )


def rotary_and_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``rotary_embedding(positions, q, k, cos_sin_cache, head_dim)`` then
    ``store_kv_cache(k, v, kv_cache, slot_mapping)``, in one kernel.

    q and k are rotated **in place** (as by rotary_embedding, whose argument
    rules apply); the rotated k and v are written to
    ``kv_cache[:, head, slot // block_size, slot % block_size]`` for each token's
    ``slot = slot_mapping[t]``; slot -1 (padding) writes nothing. v: [tokens,
    num_kv_heads * head_dim] like k, not modified; q, k and v may be column
    slices of one fused qkv output. kv_cache: [2, num_kv_heads, blocks,
    block_size, head_dim] of q's dtype, unit last stride; slot_mapping: int64
    [>= tokens] (only the first ``tokens`` entries are read). Slots are not
    range-checked (no host sync): each must be < blocks * block_size.
    """
    _check_rotary_args(positions, q, k, cos_sin_cache, head_dim)
    _check_store_args(k, v, head_dim, kv_cache, slot_mapping)
    tokens = q.shape[0]
    if tokens == 0:
        return
    _rotary_store_kv_kernel[(tokens,)](
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        kv_cache,
        slot_mapping,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        cos_sin_cache.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        q.shape[1] // head_dim,
        k.shape[1] // head_dim,
        BLOCK_SIZE=kv_cache.shape[3],
        **_head_blocks(q, k, head_dim),
        **pdl.launch_kwargs(q),
    )
