"""The Triton kernels of the fused mixture-of-experts
(:mod:`asyncstep.ops.triton.fused_moe` launches them and states the
contract).

Rows are token-expert *pairs* ``p = t * top_k + j`` (token t's j-th
expert), listed by :func:`~asyncstep.ops.triton.moe_routing.moe_align_block_size`
in blocks of BLOCK_M pairs of one expert each (padding entries hold the
pair count, an out-of-range pair, so their rows are masked). A program
takes one block and BLOCK_N output columns:

* :func:`gate_up_kernel`: the pairs' tokens' rows of ``hidden`` times the
  expert's gate rows and up rows of ``w13`` (two float32 accumulators
  sharing each x tile), the optional bias, the activation (``silu(gate) *
  up`` or gpt-oss's clamped ``(up + 1) * gate * sigmoid(alpha * gate)``) in
  float32, stored in the activations' dtype at the pair's row.
* :func:`down_kernel`: the pairs' activation rows times the expert's
  ``w2`` rows, the optional bias, times the pair's routing weight, stored
  in float32 at the pair's row.
* :func:`combine_kernel`: a token's k pair rows summed in float32, j from
  0 up, stored in the output's dtype.

The small-T path reads ``topk_ids`` in place (no alignment), a program per
pair (gate/up) or per token (down), each streaming an expert's weight rows
BLOCK_K wide into a float32 ``[BLOCK_N, BLOCK_K]`` accumulator reduced once:

* :func:`gemv_gate_up_kernel`: :func:`gate_up_kernel`'s rows of one pair.
* :func:`gemv_down_kernel`: a token's k experts' down rows, bias and routing
  weight, summed j from 0 up: :func:`down_kernel` and :func:`combine_kernel`
  in one.

Every output element is its K loop from 0 up in BLOCK_K steps, one
``tl.dot`` a step: no split-K, no atomics, nothing chosen by the number of
rows, so a pair's values do not depend on which other pairs share its
block. Blocks whose expert id is negative (past the last expert's run)
return at once.

Every kernel launches with programmatic dependent launch where the GPU has
it (:mod:`asyncstep.ops.triton.pdl`): it lets the next kernel launch, then
waits for the kernel before, first thing.

May import triton and :mod:`asyncstep.ops.triton.pdl`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncstep.ops.triton.pdl import launch_then_wait

__all__ = [
    "ACTIVATIONS",
    "ACT_SILU",
    "ACT_SWIGLUOAI",
    "SWIGLU_ALPHA",
    "SWIGLU_LIMIT",
    "activate",
    "combine_kernel",
    "down_kernel",
    "gate_up_kernel",
    "gemv_down_kernel",
    "gemv_gate_up_kernel",
]

#: ``ACTIVATION`` values of :func:`gate_up_kernel`.
ACT_SILU: tl.constexpr = tl.constexpr(0)
ACT_SWIGLUOAI: tl.constexpr = tl.constexpr(1)
#: The activations by name and their ``ACTIVATION`` codes.
ACTIVATIONS = {"silu": ACT_SILU.value, "swigluoai": ACT_SWIGLUOAI.value}
#: gpt-oss's swigluoai constants (``swiglu_alpha``, ``swiglu_limit``).
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@triton.jit
def activate(
    gate: tl.tensor, up: tl.tensor, alpha: tl.tensor, limit: tl.tensor, ACTIVATION: tl.constexpr
) -> tl.tensor:
    """The activation of float32 gate and up values: ``silu(gate) * up``, or
    gpt-oss's clamped ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    if ACTIVATION == ACT_SILU:
        return gate / (1.0 + tl.exp(-gate)) * up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))


# The pair count changes every step: one compiled variant for every count.
@triton.jit(do_not_specialize=["num_pairs"])
def gate_up_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    sorted_ids_ptr: tl.tensor,
    expert_ids_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_pairs: tl.tensor,
    top_k: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    up_offset: tl.tensor,
    stride_xt: tl.tensor,
    stride_xk: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_be: tl.tensor,
    stride_bn: tl.tensor,
    stride_op: tl.tensor,
    stride_on: tl.tensor,
    alpha: tl.tensor,
    limit: tl.tensor,
    ROW_STEP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(blocks, cdiv(N, BLOCK_N))``; N is the intermediate size I.
    Column n's gate is w13 row ``n * ROW_STEP``, its up row
    ``up_offset + n * ROW_STEP`` (gate rows then up rows: 1 and I;
    interleaved: 2 and 1). UPCAST multiplies float32 copies of the tiles
    (the interpreter's dot cannot take bfloat16)."""
    launch_then_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))
    pairs = pairs.to(tl.int64)
    row_mask = pairs < num_pairs
    tokens = pairs // top_k
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xk
    w_base = w_ptr + expert * stride_we
    g_ptrs = w_base + (cols * ROW_STEP)[None, :] * stride_wn + ks[:, None] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(x, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(x, u, acc_u, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        b_g = tl.load(b_base + cols * ROW_STEP * stride_bn, mask=col_mask, other=0.0)
        b_u = tl.load(b_base + (up_offset + cols * ROW_STEP) * stride_bn, mask=col_mask, other=0.0)
        acc_g += b_g.to(tl.float32)[None, :]
        acc_u += b_u.to(tl.float32)[None, :]
    act = activate(acc_g, acc_u, alpha, limit, ACTIVATION)
    out_ptrs = out_ptr + pairs[:, None] * stride_op + cols[None, :] * stride_on
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def down_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    route_ptr: tl.tensor,
    sorted_ids_ptr: tl.tensor,
    expert_ids_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_pairs: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_xp: tl.tensor,
    stride_xk: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_be: tl.tensor,
    stride_bn: tl.tensor,
    stride_op: tl.tensor,
    stride_on: tl.tensor,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(blocks, cdiv(N, BLOCK_N))``; N is the hidden size H, K the
    intermediate size I; x is the activation ``[pairs, I]``, route the
    routing weights ``[pairs]`` (float32), out ``[pairs, H]`` float32."""
    launch_then_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M))
    pairs = pairs.to(tl.int64)
    row_mask = pairs < num_pairs
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + pairs[:, None] * stride_xp + ks[None, :] * stride_xk
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        b = tl.load(bias_ptr + expert * stride_be + cols * stride_bn, mask=col_mask, other=0.0)
        acc += b.to(tl.float32)[None, :]
    route = tl.load(route_ptr + pairs, mask=row_mask, other=0.0)
    acc = acc * route[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_op + cols[None, :] * stride_on
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def combine_kernel(
    pair_ptr: tl.tensor,
    out_ptr: tl.tensor,
    H: tl.tensor,
    stride_pp: tl.tensor,
    stride_ot: tl.tensor,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(T, cdiv(H, BLOCK_H))``: ``out[t] = sum_j pair[t * TOP_K + j]``,
    j from 0 up, in float32."""
    launch_then_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pair_ptr + (t * TOP_K + j) * stride_pp + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------
# the small-T path: GEMV-shaped, no alignment


@triton.jit
def gemv_gate_up_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    out_ptr: tl.tensor,
    top_k: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    up_offset: tl.tensor,
    stride_xt: tl.tensor,
    stride_xk: tl.tensor,
    stride_it: tl.tensor,
    stride_ij: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_be: tl.tensor,
    stride_bn: tl.tensor,
    stride_op: tl.tensor,
    stride_on: tl.tensor,
    alpha: tl.tensor,
    limit: tl.tensor,
    ROW_STEP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(pairs, cdiv(N, BLOCK_N))``: pair p's (token ``p // top_k``,
    expert ``ids[p // top_k, p % top_k]``) BLOCK_N activation columns, its
    gate and up rows streamed BLOCK_K wide, products summed in a float32
    ``[BLOCK_N, BLOCK_K]`` accumulator reduced once; the bias and the
    activation as :func:`gate_up_kernel`'s."""
    launch_then_wait(PDL)
    p = tl.program_id(0).to(tl.int64)
    token = p // top_k
    expert = tl.load(ids_ptr + token * stride_it + (p % top_k) * stride_ij).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xt + ks * stride_xk
    g_ptrs = w_ptr + expert * stride_we + (cols * ROW_STEP)[:, None] * stride_wn
    g_ptrs += ks[None, :] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc_g += tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        acc_u += tl.load(u_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        gate += tl.load(b_base + cols * ROW_STEP * stride_bn, mask=col_mask, other=0.0).to(
            tl.float32
        )
        up += tl.load(
            b_base + (up_offset + cols * ROW_STEP) * stride_bn, mask=col_mask, other=0.0
        ).to(tl.float32)
    act = activate(gate, up, alpha, limit, ACTIVATION)
    tl.store(
        out_ptr + p * stride_op + cols * stride_on, act.to(out_ptr.dtype.element_ty), mask=col_mask
    )


@triton.jit
def gemv_down_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    route_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    out_ptr: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_xp: tl.tensor,
    stride_xk: tl.tensor,
    stride_rt: tl.tensor,
    stride_rj: tl.tensor,
    stride_it: tl.tensor,
    stride_ij: tl.tensor,
    stride_we: tl.tensor,
    stride_wn: tl.tensor,
    stride_wk: tl.tensor,
    stride_be: tl.tensor,
    stride_bn: tl.tensor,
    stride_ot: tl.tensor,
    stride_on: tl.tensor,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
) -> None:
    """Grid ``(T, cdiv(N, BLOCK_N))``; N is H, K is I; x the activations
    ``[pairs, I]``: token t's BLOCK_N output columns, its k experts' down
    rows times their pair's activation row (a float32 ``[BLOCK_N, BLOCK_K]``
    accumulator reduced once), plus the bias, times the routing weight,
    summed in float32 j from 0 up (:func:`combine_kernel`'s order), stored
    in the output's dtype."""
    launch_then_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + t * stride_it + j * stride_ij).to(tl.int64)
        x_ptrs = x_ptr + (t * TOP_K + j) * stride_xp + ks * stride_xk
        w_ptrs = w_ptr + expert * stride_we + cols[:, None] * stride_wn + ks[None, :] * stride_wk
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
            w_mask = col_mask[:, None] & k_mask[None, :]
            acc += tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32) * x
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            b = tl.load(bias_ptr + expert * stride_be + cols * stride_bn, mask=col_mask, other=0.0)
            y += b.to(tl.float32)
        out += y * tl.load(route_ptr + t * stride_rt + j * stride_rj)
    tl.store(
        out_ptr + t * stride_ot + cols * stride_on, out.to(out_ptr.dtype.element_ty), mask=col_mask
    )
