"""The Triton kernels of the packed Q4 / Q8 weights
(:mod:`asyncstep.ops.triton.quant_layout`): the GEMV with its prologues and
epilogues, the tiled GEMM that dequantizes each weight tile in registers,
and the dequantizer; launched by :mod:`asyncstep.ops.triton.quant`, whose
docstring gives their arithmetic.

May import triton and its sibling modules quant_packed and pdl.
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncstep.ops.triton.pdl import launch_dependents, wait_prior
from asyncstep.ops.triton.quant_packed import _q4_block_dot, _q8_block_dot

#: 2**23: the float32 whose mantissa holds a small integer OR-ed into it.
_MAGIC_F32: tl.constexpr = tl.constexpr(8388608.0)
_MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B000000)
#: The GEMV scales x by 2**(_X_EXP - 4 s') before it meets a code read as a
#: subnormal float (see :func:`asyncstep.ops.triton.quant.q4_gemv`), and d by 2**(149 - _X_EXP).
_X_EXP: tl.constexpr = tl.constexpr(88)
_D_SCALE: tl.constexpr = tl.constexpr(2.0 ** (149 - 88))


@triton.jit
def _fp16_pair(sm):  # type: ignore[no-untyped-def]
    """(d, m) in float32 from an int32 holding two float16s (d in the low half)."""
    d = (sm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    m = (sm >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d, m


@triton.jit
def _nibble(words, lo_w, hi_w, S: tl.constexpr, MAGIC: tl.constexpr):  # type: ignore[no-untyped-def]
    """Nibble ``S`` of ``words`` as float32: ``q * 16**(S % 4)`` with MAGIC
    (``lo_w`` / ``hi_w``: the low / high half-words OR-ed into 2**23), else ``q``."""
    if MAGIC:
        if S < 4:
            bits = lo_w & (_MAGIC_BITS | (15 << (4 * S)))
        else:
            bits = hi_w & (_MAGIC_BITS | (15 << (4 * (S - 4))))
        q = bits.to(tl.float32, bitcast=True) - _MAGIC_F32
    else:
        q = ((words >> (4 * S)) & 15).to(tl.float32)
    return q


@triton.jit
def _magic_halves(words, MAGIC: tl.constexpr):  # type: ignore[no-untyped-def]
    """The low and high 16 bits of ``words``, each OR-ed into 2**23 (MAGIC only)."""
    if MAGIC:
        lo_w = (words & 0xFFFF) | _MAGIC_BITS
        hi_w = ((words >> 16) & 0xFFFF) | _MAGIC_BITS
    else:
        lo_w = words
        hi_w = words
    return lo_w, hi_w


@triton.jit
def _load_chunk(  # type: ignore[no-untyped-def]
    qw_ptr,
    sm_ptr,
    n64,
    n_mask,
    g0,
    K_GROUPS,
    BLOCK_G: tl.constexpr,
    WORDS: tl.constexpr,
    EVEN: tl.constexpr,
):
    """The packed words ``[BN, BLOCK_G, WORDS]`` and the scale/offset pairs
    ``[BN, BLOCK_G]`` of rows ``n64``, blocks ``g0 ..`` (``WORDS`` int32
    words a block; zeros outside; EVEN: all inside, unmasked). The words load
    as ``[BN, BLOCK_G * WORDS]`` rows, so that the compiler sees a row's run
    as contiguous and spreads a warp's lanes along it."""
    c = tl.arange(0, BLOCK_G * WORDS)
    gg = g0 + tl.arange(0, BLOCK_G)
    words_at = qw_ptr + n64[:, None] * (K_GROUPS * WORDS) + (g0 * WORDS + c)[None, :]
    sm_at = sm_ptr + n64[:, None] * K_GROUPS + gg[None, :]
    if EVEN:
        words = tl.load(words_at)
        sm = tl.load(sm_at)
    else:
        c_mask = (g0 + c // WORDS) < K_GROUPS
        words = tl.load(words_at, mask=n_mask[:, None] & c_mask[None, :], other=0)
        sm = tl.load(sm_at, mask=n_mask[:, None] & (gg < K_GROUPS)[None, :], other=0)
    return tl.reshape(words, [n64.shape[0], BLOCK_G, WORDS]), sm


@triton.jit
def _load_x(at, mask, EVEN: tl.constexpr):  # type: ignore[no-untyped-def]
    """x at ``at`` in float32 (zeros outside ``mask``; EVEN: unmasked)."""
    if EVEN:  # noqa: SIM108 (a compile-time branch)
        xv = tl.load(at)
    else:
        xv = tl.load(at, mask=mask, other=0.0)
    return xv.to(tl.float32)


#: The GEMV's prologue (what it makes of the rows it reads): x as it is;
#: ``rms_norm(x) * weight`` (RMS_NORM: each program sums the squares of the
#: row it reads, the norm's scale applied to the dot products); or x already
#: multiplied by the norm's weight, the squares of the raw row summed in
#: parts by the kernel that wrote it (NORMED: see the NEXT_NORM epilogue).
PROLOGUE_NONE: tl.constexpr = tl.constexpr(0)
PROLOGUE_RMS_NORM: tl.constexpr = tl.constexpr(1)
PROLOGUE_NORMED: tl.constexpr = tl.constexpr(2)


@triton.jit
def _x_tile(  # type: ignore[no-untyped-def]
    x_row,
    nw_row,
    x_mask,
    S: tl.constexpr,
    BITS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    X_EVEN: tl.constexpr,
):
    """Tile ``S`` of a block's x (features ``BITS S + t``) in float32, the
    prologue's norm weight applied, and its raw squares."""
    xr = _load_x(x_row + BITS * S, x_mask, X_EVEN)
    if PROLOGUE == PROLOGUE_RMS_NORM:  # noqa: SIM108 (a compile-time branch)
        xv = xr * _load_x(nw_row + BITS * S, x_mask, X_EVEN)
    else:
        xv = xr
    return xv, xr * xr


@triton.jit
def _gemv_chunk(  # type: ignore[no-untyped-def]
    acc,
    acc1,
    sq_acc,
    words,
    sm,
    g0,
    x_ptr,
    nw_ptr,
    M,
    K_GROUPS,
    stride_xm,
    pid_m,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    X_EVEN: tl.constexpr,
    PROLOGUE: tl.constexpr,
    INT8: tl.constexpr,
    ASM: tl.constexpr,
):
    """One loop step of :func:`_gemv_kernel`: the products of the chunk of
    blocks ``g0 ..`` (its ``words`` and scale pairs ``sm``) with each row of
    x, added to the accumulators ``(acc, acc1, sq_acc)``, returned."""
    CODES: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    gg = g0 + tl.arange(0, BLOCK_G)
    g_mask = gg < K_GROUPS
    t = tl.arange(0, BITS)
    m_idx = tl.arange(0, BLOCK_M)
    d, m = _fp16_pair(sm)  # [BN, BG]
    if not INT8:
        d = d * _D_SCALE
        high = words >> 8
    for mi in tl.static_range(BLOCK_M):
        row = pid_m * BLOCK_M + mi
        # x as [1, BG, BITS] tiles: laid out as the words are, each thread
        # converts and scales its x once for all its rows.
        x_row = x_ptr + row.to(tl.int64) * stride_xm + gg[None, :, None] * 32 + t[None, None, :]
        # (the row test as a tensor: the interpreter cannot mask with a scalar;
        # X_EVEN: no mask)
        x_mask = g_mask[None, :, None] & ((row + 0 * t) < M)[None, None, :]
        nw_row = nw_ptr + gg[None, :, None] * 32 + t[None, None, :]
        # (one row: the products added to acc1 itself, as FFMAs; a compile-time branch)
        if BLOCK_M == 1 and INT8:  # noqa: SIM108
            base = acc1
        else:
            base = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
        if INT8 and BITS == 4:
            x0, xsq = _x_tile(x_row, nw_row, x_mask, 0, BITS, PROLOGUE, X_EVEN)
            x1, q1 = _x_tile(x_row, nw_row, x_mask, 1, BITS, PROLOGUE, X_EVEN)
            x2, q2 = _x_tile(x_row, nw_row, x_mask, 2, BITS, PROLOGUE, X_EVEN)
            x3, q3 = _x_tile(x_row, nw_row, x_mask, 3, BITS, PROLOGUE, X_EVEN)
            x4, q4 = _x_tile(x_row, nw_row, x_mask, 4, BITS, PROLOGUE, X_EVEN)
            x5, q5 = _x_tile(x_row, nw_row, x_mask, 5, BITS, PROLOGUE, X_EVEN)
            x6, q6 = _x_tile(x_row, nw_row, x_mask, 6, BITS, PROLOGUE, X_EVEN)
            x7, q7 = _x_tile(x_row, nw_row, x_mask, 7, BITS, PROLOGUE, X_EVEN)
            xsq += q1 + q2 + q3 + q4 + q5 + q6 + q7
            part = _q4_block_dot(base, words, d, m, x0, x1, x2, x3, x4, x5, x6, x7, ASM)
        elif INT8:
            x0, xsq = _x_tile(x_row, nw_row, x_mask, 0, BITS, PROLOGUE, X_EVEN)
            x1, q1 = _x_tile(x_row, nw_row, x_mask, 1, BITS, PROLOGUE, X_EVEN)
            x2, q2 = _x_tile(x_row, nw_row, x_mask, 2, BITS, PROLOGUE, X_EVEN)
            x3, q3 = _x_tile(x_row, nw_row, x_mask, 3, BITS, PROLOGUE, X_EVEN)
            xsq += q1 + q2 + q3
            part = _q8_block_dot(base, words, d, m, x0, x1, x2, x3, ASM)
        else:
            # A code masked in place (for the top byte: in the word shifted
            # right by 8) read as a float32 is code * 2**(p - 149), p its bit
            # offset (every bit pattern below 2**24 is its integer times
            # 2**-149), so one AND makes the multiplicand; x, scaled by
            # 2**(X_EXP - p), brings the product to code * x * 2**(X_EXP - 149),
            # and d carries 2**(149 - X_EXP).
            xv, xsq = _x_tile(x_row, nw_row, x_mask, 0, BITS, PROLOGUE, X_EVEN)
            xsum = xv
            dots = (words & MASK).to(tl.float32, bitcast=True) * (xv * (2.0**_X_EXP))
            for s in tl.static_range(1, CODES):
                xv, xsq_s = _x_tile(x_row, nw_row, x_mask, s, BITS, PROLOGUE, X_EVEN)
                xsq += xsq_s
                xsum += xv
                if BITS * (s + 1) <= 24:
                    bits = words & (MASK << (BITS * s))
                    xv = xv * (2.0 ** (_X_EXP - BITS * s))
                else:
                    bits = high & (MASK << (BITS * s - 8))
                    xv = xv * (2.0 ** (_X_EXP - BITS * s + 8))
                dots += bits.to(tl.float32, bitcast=True) * xv
            part = tl.sum(dots, axis=2) * d + m * tl.sum(xsum, axis=2)
        if BLOCK_M == 1 and INT8:
            acc1 = part
        elif BLOCK_M == 1:
            acc1 += part
        else:
            acc = tl.where((m_idx == mi)[:, None, None], acc + part[None, :, :], acc)
        if PROLOGUE == PROLOGUE_RMS_NORM:
            sq = tl.sum(xsq, axis=2)  # [1, BG]
            if BLOCK_M == 1:
                sq_acc += sq
            else:
                sq_acc = tl.where((m_idx == mi)[:, None], sq_acc + sq, sq_acc)
    return acc, acc1, sq_acc


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    qw_ptr,
    sm_ptr,
    out_ptr,
    nw_ptr,
    sq_ptr,
    res_ptr,
    next_nw_ptr,
    xw_ptr,
    sq_out_ptr,
    M,
    N,
    K_GROUPS,
    stride_xm,
    stride_om,
    stride_sq,
    stride_rm,
    stride_xwm,
    stride_sqo,
    n_sq_parts,
    eps,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr = 0,
    SQ_BLOCK: tl.constexpr = 1,
    RESIDUAL: tl.constexpr = False,
    SILU_PAIRS: tl.constexpr = False,
    NEXT_NORM: tl.constexpr = False,
    INT8: tl.constexpr = False,
    ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # A block is BITS words; code s (bits BITS s ..) of word t is feature BITS s + t.
    # Unmasked x: every block inside, and one row a program (a program per row).
    X_EVEN: tl.constexpr = EVEN and BLOCK_M == 1
    # Launched with PDL (asyncstep.ops.triton.pdl), the next kernel may start now: it
    # waits for this one before it reads what this one writes.
    launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    m_idx = tl.arange(0, BLOCK_M)
    rows = pid_m * BLOCK_M + m_idx
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_G], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)  # (one row: acc's)
    # RMS_NORM: each row's sum of squares, per block (every program reads the
    # whole row of x anyway); the norm's scale multiplies the dot products.
    sq_acc = tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.float32)
    if PREFETCH:
        # Each step loads the next chunk's words before it multiplies its own
        # (loaded a step ago); the last chunk, after the loop, loads nothing.
        words_next, sm_next = _load_chunk(
            qw_ptr, sm_ptr, n64, n_mask, 0, K_GROUPS, BLOCK_G, BITS, EVEN
        )
    # With PDL the kernel before may still run: the weights are nobody's
    # output; x, the parts, the residual and this kernel's outputs are.
    wait_prior(PDL)
    if PROLOGUE == PROLOGUE_NORMED:  # the parts' loads ahead of the loop
        parts = tl.arange(0, SQ_BLOCK)
        sq_parts = tl.load(
            sq_ptr + rows.to(tl.int64)[:, None] * stride_sq + parts[None, :],
            mask=(rows < M)[:, None] & (parts < n_sq_parts)[None, :],
            other=0.0,
        )
    if PREFETCH:
        for g0 in tl.range(0, K_GROUPS - BLOCK_G, BLOCK_G, num_stages=STAGES):
            words = words_next
            sm = sm_next
            words_next, sm_next = _load_chunk(
                qw_ptr, sm_ptr, n64, n_mask, g0 + BLOCK_G, K_GROUPS, BLOCK_G, BITS, EVEN
            )
            acc, acc1, sq_acc = _gemv_chunk(
                acc,
                acc1,
                sq_acc,
                words,
                sm,
                g0,
                x_ptr,
                nw_ptr,
                M,
                K_GROUPS,
                stride_xm,
                pid_m,
                BITS,
                BLOCK_M,
                BLOCK_N,
                BLOCK_G,
                X_EVEN,
                PROLOGUE,
                INT8,
                ASM,
            )
        last = tl.cdiv(K_GROUPS, BLOCK_G) * BLOCK_G - BLOCK_G
        acc, acc1, sq_acc = _gemv_chunk(
            acc,
            acc1,
            sq_acc,
            words_next,
            sm_next,
            last,
            x_ptr,
            nw_ptr,
            M,
            K_GROUPS,
            stride_xm,
            pid_m,
            BITS,
            BLOCK_M,
            BLOCK_N,
            BLOCK_G,
            X_EVEN,
            PROLOGUE,
            INT8,
            ASM,
        )
    else:
        for g0 in tl.range(0, K_GROUPS, BLOCK_G, num_stages=STAGES):
            words, sm = _load_chunk(qw_ptr, sm_ptr, n64, n_mask, g0, K_GROUPS, BLOCK_G, BITS, EVEN)
            acc, acc1, sq_acc = _gemv_chunk(
                acc,
                acc1,
                sq_acc,
                words,
                sm,
                g0,
                x_ptr,
                nw_ptr,
                M,
                K_GROUPS,
                stride_xm,
                pid_m,
                BITS,
                BLOCK_M,
                BLOCK_N,
                BLOCK_G,
                X_EVEN,
                PROLOGUE,
                INT8,
                ASM,
            )
    if BLOCK_M == 1:  # noqa: SIM108 (a compile-time branch)
        out = tl.sum(acc1, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    if PROLOGUE == PROLOGUE_RMS_NORM:
        inv_rms = tl.rsqrt(tl.sum(sq_acc, axis=1) / (K_GROUPS * 32) + eps)
        out = out * inv_rms[:, None]
    elif PROLOGUE == PROLOGUE_NORMED:
        inv_rms = tl.rsqrt(tl.sum(sq_parts, axis=1) / (K_GROUPS * 32) + eps)
        out = out * inv_rms[:, None]
    rows64 = rows.to(tl.int64)
    out_mask = (rows < M)[:, None] & n_mask[None, :]
    if RESIDUAL:
        # As the unfused layer: the product rounded to the output's dtype,
        # then the residual added in float32 and rounded again.
        res = tl.load(
            res_ptr + rows64[:, None] * stride_rm + n64[None, :], mask=out_mask, other=0.0
        )
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
    if SILU_PAIRS:
        # Rows 2 j, 2 j + 1 are gate j and up j: silu(gate) * up, each rounded
        # to the output's dtype first, as silu_and_mul reads and stores them.
        gate, up = tl.split(
            tl.reshape(out.to(out_ptr.dtype.element_ty).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2])
        )
        half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(
            out_ptr + rows64[:, None] * stride_om + half.to(tl.int64)[None, :],
            (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
            mask=(rows < M)[:, None] & (half < N // 2)[None, :],
        )
    else:
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows64[:, None] * stride_om + n64[None, :], out, mask=out_mask)
    if NEXT_NORM:
        # The next RMS norm's input: the output (as stored) times the norm's
        # weight, rounded to the output's dtype, and the sum (float32) of its
        # squares over this program's features (one part of the row's sum; a
        # PROLOGUE_NORMED kernel adds them).
        stream = out.to(tl.float32)
        weight = tl.load(next_nw_ptr + n64, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(
            xw_ptr + rows64[:, None] * stride_xwm + n64[None, :],
            (stream * weight[None, :]).to(xw_ptr.dtype.element_ty),
            mask=out_mask,
        )
        sq_part = tl.sum(tl.where(out_mask, stream * stream, 0.0), axis=1)
        tl.store(sq_out_ptr + rows64 * stride_sqo + pid_n, sq_part, mask=rows < M)


@triton.jit
def _q4_dot_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    qw_ptr,
    sm_ptr,
    out_ptr,
    M,
    N,
    K_GROUPS,
    stride_xm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    MAGIC: tl.constexpr,
    SWAP: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, 4)
    # Column c of a nibble position's x tile: block c // 4, feature t = c % 4.
    c = tl.arange(0, BLOCK_G * 4)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, K_GROUPS, BLOCK_G):
        gg = g0 + g
        g_mask = gg < K_GROUPS
        sm = tl.load(
            sm_ptr + n64[:, None] * K_GROUPS + gg[None, :],
            mask=n_mask[:, None] & g_mask[None, :],
            other=0,
        )
        d, m = _fp16_pair(sm)
        d = d[:, :, None]
        m = m[:, :, None]
        words = tl.load(
            qw_ptr + n64[:, None, None] * (K_GROUPS * 4) + gg[None, :, None] * 4 + t[None, None, :],
            mask=n_mask[:, None, None] & g_mask[None, :, None],
            other=0,
        )
        lo_w, hi_w = _magic_halves(words, MAGIC)
        cg = g0 + c // 4
        x_mask = row_mask[:, None] & (cg < K_GROUPS)[None, :]
        x_base = x_ptr + rows64[:, None] * stride_xm + (cg * 32 + c % 4)[None, :]
        for s in tl.static_range(8):
            q = _nibble(words, lo_w, hi_w, s, MAGIC)
            if MAGIC:  # noqa: SIM108 (a compile-time branch)
                w = q * (d * (1.0 / (16 ** (s % 4)))) + m
            else:
                w = q * d + m
            w = tl.reshape(w, [BLOCK_N, BLOCK_G * 4]).to(x_ptr.dtype.element_ty)
            xs = tl.load(x_base + 4 * s, mask=x_mask, other=0.0)
            if SWAP:
                if IEEE:
                    acc = tl.dot(w, tl.trans(xs), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, tl.trans(xs), acc)
            elif IEEE:
                acc = tl.dot(xs, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, tl.trans(w), acc)
    if SWAP:
        tl.store(
            out_ptr + rows64[None, :] * stride_om + n64[:, None],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[None, :] & n_mask[:, None],
        )
    else:
        tl.store(
            out_ptr + rows64[:, None] * stride_om + n64[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & n_mask[None, :],
        )


@triton.jit
def _q4_dequant_kernel(  # type: ignore[no-untyped-def]
    qw_ptr,
    sm_ptr,
    out_ptr,
    N,
    K_GROUPS,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    # One tile of the output [BN, BG * 32], written in order: element k of the
    # chunk is nibble s = (k % 32) // 4 of word t = k % 4 of block k // 32
    # (each word is read 8 times, from L1).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_G * 32)
    gk = tl.program_id(1) * BLOCK_G + k // 32
    n64 = n.to(tl.int64)
    mask = (n < N)[:, None] & (gk < K_GROUPS)[None, :]
    words = tl.load(
        qw_ptr + n64[:, None] * (K_GROUPS * 4) + (gk * 4 + k % 4)[None, :], mask=mask, other=0
    )
    sm = tl.load(sm_ptr + n64[:, None] * K_GROUPS + gk[None, :], mask=mask, other=0)
    d, m = _fp16_pair(sm)
    q = ((words >> (4 * ((k % 32) // 4))[None, :]) & 15).to(tl.float32)
    out = out_ptr + n64[:, None] * (K_GROUPS * 32) + (gk * 32 + k % 32)[None, :]
    tl.store(out, (q * d + m).to(out_ptr.dtype.element_ty), mask=mask)
