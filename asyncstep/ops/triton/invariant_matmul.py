"""The batch-invariant matmul (issue 40): ``x @ w.T`` whose every output
element is summed in float32 over K in one fixed order, whatever the number
of rows.

:func:`invariant_matmul` multiplies x ``[M, K]`` by w ``[N, K]`` (float32,
float16 or bfloat16, one dtype) into ``[M, N]`` of ``out_dtype`` (x's dtype
for a linear layer, float32 for the LM head's logits).

The order of an output element's sum depends on (N, K) alone:

* one tile configuration (:data:`TILE`: BLOCK_M, BLOCK_N, BLOCK_K, warps)
  for every M, so each BLOCK_K-wide ``tl.dot`` chunk is the same
  instruction whatever M is; on CUDA a prompt-sized step launches one of
  :data:`PROMPT_TILES`, whose chunks are the same chain of MMA steps per
  element (their bits are TILE's: tested on CUDA);
* K is cut into *splits* of :func:`split_k` ``(N, K)`` features (a multiple
  of BLOCK_K; the last split takes the rest): a split's chunks are summed in
  K order into a float32 partial starting from zero, then the partials are
  added in split order to a float32 total starting from zero, rounded once
  to ``out_dtype``.

Three launches compute that same order, chosen from the step's shape
only (:func:`launch_is_parallel`, :func:`launch_tile`): a step of few
output tiles (a decode batch) runs one program per (tile, split), each
writing its float32 partial to a scratch, and the tile's last program to
finish (its arrival counter: :mod:`~asyncstep.ops.triton.invariant_counters`)
adds the partials in split order; larger steps run one program per tile
adding its splits' partials in a loop; prompt-sized ones on CUDA, the
same by TMA (:mod:`~asyncstep.ops.triton.invariant_prompt`). So row i is
the same bits alone (a decode), with k others of its request (a
speculative verify) or among hundreds of rows (a prefill chunk). Rows past
M and columns past N read as zeros, which touch no other element's sum.
float32 multiplies in IEEE float32 (no TF32). Grids and scratch come from
shapes only: no host sync, CUDA-graph safe. With PDL
(:mod:`asyncstep.ops.triton.pdl`) the next kernel may launch while this
one drains.

May import torch, triton, :mod:`asyncstep.ops.triton.pdl`,
:mod:`asyncstep.ops.triton.invariant_counters` (the split programs'
arrival counters) and :mod:`asyncstep.ops.triton.invariant_prompt`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncstep.ops.triton import pdl
from asyncstep.ops.triton.invariant_counters import tile_counters
from asyncstep.ops.triton.invariant_prompt import prompt_matmul, tma_fits
from asyncstep.ops.triton.pdl import launch_dependents, wait_prior

__all__ = [
    "MIN_SPLIT_K",
    "PARALLEL_WAVES",
    "PROMPT_TILES",
    "TARGET_PROGRAMS",
    "TILE",
    "MatmulTile",
    "invariant_matmul",
    "launch_is_parallel",
    "launch_tile",
    "split_k",
]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MatmulTile:
    """The launch configuration of every M (changing it may change the bits,
    never their independence of M). ``split_stages``: the pipeline depth of
    the split programs (it does not change the arithmetic)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_stages: int


#: 64 rows: one warpgroup's MMA shape on Hopper, for M = 1 as for M = 4096;
#: 128-feature chunks. Chosen by the tile sweep on one H100 (every
#: BLOCK_N 32-128 x BLOCK_K 64-128 x 4-8 warps x TARGET_PROGRAMS x stages at
#: llama-8b's four layer shapes, benchmarks/results/invariance_gpu/h100_1206/):
#: the one tile among each shape's best at M = 1, 1.03-1.30x the floor.
TILE = MatmulTile(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, split_stages=4)
#: The tiles of prompt-sized steps on CUDA, as (fewest rows, tile), most
#: rows first, with TILE's splits. On the tensor cores an element's sum is
#: the same chain of MMA steps whatever the tile (every tile of the
#: prompt-tile sweep gave TILE's bits on an H100; the tests on CUDA check
#: these); off CUDA, where ``tl.dot`` is numpy's and rounds by block shape,
#: every step runs TILE. From that sweep (results: invariance_gpu/h100_1206b/).
PROMPT_TILES: tuple[tuple[int, MatmulTile], ...] = (
    (1024, MatmulTile(128, 256, 64, num_warps=8, num_stages=4, split_stages=4)),
    (256, MatmulTile(128, 128, 64, num_warps=8, num_stages=5, split_stages=5)),
)
#: Prompt tiles load by TMA where the tensors allow (the same bits; False:
#: the pointer kernel). Their device types (tests add the interpreter's).
_PROMPT_TMA = True
_PROMPT_TILE_DEVICES = frozenset({"cuda"})
#: The programs :func:`split_k` aims at for a step of one row tile (N / BLOCK_N
#: tiles x splits): about one wave of a 132-SM GPU. A constant, not the SM
#: count: the bits must not depend on the GPU's size (the sweep above).
TARGET_PROGRAMS = 128
#: The fewest features a split takes (a multiple of every BLOCK_K).
MIN_SPLIT_K = 256
#: The split programs run while the step's tiles fill at most this many
#: waves of the GPU's SMs (a launch choice: it does not change the bits).
PARALLEL_WAVES = 4

_DEFAULT_NUM_SMS = 132  # off CUDA (the interpreter's launches are the tests' choice)


def split_k(n: int, k: int, tile: MatmulTile | None = None) -> int:
    """The features a split sums for an ``[n, k]`` weight (a multiple of
    ``tile.block_k``; ``>= k`` when K is not split): splits enough for
    :data:`TARGET_PROGRAMS` programs over N's column tiles, each at least
    :data:`MIN_SPLIT_K` features, cut evenly in BLOCK_K steps. A function
    of (N, K) only (``tile``: :data:`TILE` where None)."""
    tile = tile or TILE
    n_tiles = max(1, triton.cdiv(n, tile.block_n))
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, n_tiles), k // MIN_SPLIT_K))
    return triton.cdiv(triton.cdiv(max(k, 1), splits), tile.block_k) * tile.block_k


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _DEFAULT_NUM_SMS


def _max_parallel_tiles(device: torch.device) -> int:
    return PARALLEL_WAVES * _num_sms(device)


def launch_tile(m: int, parallel: bool, device: torch.device, dtype: torch.dtype) -> MatmulTile:
    """The tile ``m`` rows launch: the first of :data:`PROMPT_TILES` they
    reach, a program per tile of 16-bit rows on CUDA (float32's blocks would
    outgrow an SM's shared memory); else :data:`TILE`."""
    if not parallel and dtype != torch.float32 and device.type in _PROMPT_TILE_DEVICES:
        for rows, tile in PROMPT_TILES:
            if m >= rows:
                return tile
    return TILE


def launch_is_parallel(
    m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> bool:
    """Whether an ``[m, k] x [n, k]`` product runs the split programs
    rather than a program per tile (the same bits either way): not a prompt
    tile's step (:func:`launch_tile`), K is split, the output tiles fill at
    most :data:`PARALLEL_WAVES` waves, and the float32 partials (written,
    then read: ``splits x m x n x 8`` bytes) weigh at most the 16-bit
    weight (``n x k x 2``)."""
    t = TILE
    if launch_tile(m, False, device, dtype) is not t:
        return False
    splits = triton.cdiv(k, split_k(n, k, t))
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    return splits > 1 and tiles <= _max_parallel_tiles(device) and splits * m * 4 <= k


@triton.jit
def _split_sum(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    rows: tl.tensor,
    cols: tl.tensor,
    row_mask: tl.tensor,
    col_mask: tl.tensor,
    k_start: tl.tensor,
    k_end: tl.tensor,
    stride_xm: tl.tensor,
    stride_xk: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
) -> tl.tensor:
    """One split's float32 partial of the tile: its BLOCK_K chunks of
    ``k_start .. k_end`` in K order, from zero."""
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_start + ks)[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k_start + ks)[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + ks) < k_end
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


# M changes every step: one compiled variant for every M (no M == 1 or
# multiple-of-16 specialisation, which could compile the dot otherwise).
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_ptr: tl.tensor,
    count_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    K_SPLIT: tl.tensor,
    SPLITS: tl.tensor,
    stride_xm: tl.tensor,
    stride_xk: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_om: tl.tensor,
    stride_on: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARALLEL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    """Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``, times ``SPLITS`` on
    axis 2 with ``PARALLEL``: the tile's ``SPLITS`` partials (each over
    ``K_SPLIT`` features from zero) added in split order from zero. With
    ``PARALLEL`` a program computes one split's partial into ``part``
    (``[SPLITS, M, N]`` float32) and bumps the tile's counter; the tile's
    last one adds the partials and resets the counter."""
    launch_dependents(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    # The kernel before may still run (PDL): it may be writing x.
    wait_prior(PDL)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PARALLEL:
        split = tl.program_id(2)
        k_start = split * K_SPLIT
        part = _split_sum(
            x_ptr,
            w_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            k_start,
            tl.minimum(k_start + K_SPLIT, K),
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            DOT_PRECISION,
        )
        part_ptrs = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(part_ptrs + split.to(tl.int64) * M * N, part, mask=mask)
        # Every thread's partial is written before the (one-thread, release)
        # arrival; the last arrival acquires the others' partials.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
            for s in range(0, SPLITS):
                plane = (s * M).to(tl.int64) * N
                total += tl.load(part_ptrs + plane, mask=mask, other=0.0, cache_modifier=".cg")
            out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(count_ptr + tile, 0)
    else:
        # One loop over K's chunks (the loads stream across the splits): a
        # split's last chunk folds its partial into the total.
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        per_split = K_SPLIT // BLOCK_K
        chunks = tl.cdiv(K, BLOCK_K)
        for c in range(0, chunks):
            k_mask = (c * BLOCK_K + ks) < K
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            part = tl.dot(x, w, part, input_precision=DOT_PRECISION)
            if ((c + 1) % per_split == 0) | (c + 1 == chunks):
                total += part
                part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    parallel: bool | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` as a new contiguous tensor of ``out_dtype`` (None:
    x's dtype): x ``[..., K]`` (its leading dimensions flattened into rows;
    any strides), weight ``[N, K]`` of x's dtype (any strides).
    ``parallel``: force the split programs (True; K split or not; a CUDA
    graph capture on a stream without counters runs a program per tile) or
    a program per tile (False); None: :func:`launch_is_parallel`. The same
    bits either way. ValueError for shapes, dtypes or devices that do not fit."""
    _check_args(x, weight, out_dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        return out.zero_().view(*lead, n)
    k_split = split_k(n, k, TILE)
    splits = triton.cdiv(k, k_split)
    if parallel is None:
        parallel = launch_is_parallel(m, n, k, x.device, x.dtype)
    tiles = triton.cdiv(m, TILE.block_m) * triton.cdiv(n, TILE.block_n)
    if parallel and tiles > _max_parallel_tiles(x.device):
        raise ValueError(f"{tiles} output tiles: too many for the split programs")
    counters = tile_counters(x.device, _max_parallel_tiles(x.device)) if parallel else None
    parallel = counters is not None
    t = launch_tile(m, parallel, x.device, x.dtype)
    if TILE.block_k % t.block_k:  # a split's chunks are whole
        raise ValueError(f"the prompt tile's BLOCK_K {t.block_k} must divide TILE's {TILE.block_k}")
    if t is not TILE and _PROMPT_TMA and tma_fits(x2, weight):
        prompt_matmul(
            x2,
            weight,
            out,
            k_split=k_split,
            block_m=t.block_m,
            block_n=t.block_n,
            block_k=t.block_k,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
            programs=_num_sms(x.device),
        )
        return out.view(*lead, n)
    grid_mn = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
    if counters is not None:
        part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    else:  # unused
        part, counters = out, out
    _invariant_matmul_kernel[(*grid_mn, splits) if parallel else grid_mn](
        x2,
        weight,
        out,
        part,
        counters,
        m,
        n,
        k,
        k_split,
        splits,
        *x2.stride(),
        *weight.stride(),
        *out.stride(),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        PARALLEL=parallel,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.num_warps,
        num_stages=t.split_stages if parallel else t.num_stages,
        **pdl.launch_kwargs(x),
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
