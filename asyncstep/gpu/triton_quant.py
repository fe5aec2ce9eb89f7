"""Weights kept 4-bit (or 8-bit) on the GPU: GGUF's Q4_0 / Q4_1 (Q8_0)
blocks as packed codes with per-block scales, and the Triton kernels that
multiply by them without a dense copy.

The layout (``Q4``) of an ``[N, K]`` weight, ``K`` a multiple of
:data:`GROUP_SIZE`, in blocks of 32 input features:

- ``qweight``: uint8 ``[N, K // 2]``, read as int32 words: word ``t`` (0..3,
  little-endian bytes ``4t..4t+3``) of block ``b`` of a row holds in its
  nibble ``s`` (bits ``4s..4s+3``, 0..7) the code of feature
  ``32 b + 4 s + t``. (Not GGUF's own order: this one lets a kernel turn a
  code into a float with one AND, and read the four features of a nibble
  position from consecutive inputs.)
- ``scales``: float16 ``[N, K // 32, 2]``: per block its scale ``d`` and its
  offset ``m``: ``w = q * d + m`` (a Q4_1 block as stored; a Q4_0 block has
  ``m = -8 d``), computed in float32.

The 8-bit layout (``Q8``) is the same with bytes for nibbles: ``qweight``
uint8 ``[N, K]``, word ``t`` (0..7) of a block holds in its byte ``s``
(0..3) the code of feature ``32 b + 8 s + t`` plus 128 (0..255), and
``scales`` holds ``(d, -128 d)`` (a Q8_0 block: ``w = (q - 128) d``).

:func:`pack_q4` / :func:`pack_q8` build the layouts from codes and scales;
:func:`dequantize_q4_reference` / :func:`dequantize_q8_reference` are the
torch references (float32).

:func:`q4_matmul` is ``x @ w.T`` for ``x`` ``[..., K]`` (float32, float16 or
bfloat16), in ``x``'s dtype, by the size of the step:

- up to :data:`GEMV_MAX_M` rows, :func:`q4_gemv`: each program streams the
  packed words of a few output rows once, for every row of ``x``, and
  accumulates ``d * sum(q x) + m * sum(x)`` per block in float32 (the
  dequantized weight is never formed; a code, masked in place, is read as a
  subnormal float32, and ``x`` is scaled by a power of two to match: the
  products are exact for ``|x| < 2**40``, and entries below ``2**-60`` in
  magnitude may lose bits);
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

May import torch and triton only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = [
    "DOT_MAX_M",
    "GEMV_MAX_M",
    "GROUP_SIZE",
    "GemvConfig",
    "dequantize_q4",
    "dequantize_q4_reference",
    "dequantize_q8_reference",
    "pack_q4",
    "pack_q8",
    "q4_dot",
    "q4_gemv",
    "q4_matmul",
    "q8_gemv",
    "q8_matmul",
]

#: Input features per block (GGUF's Q4_0 / Q4_1 block).
GROUP_SIZE = 32
#: Steps of at most this many rows take :func:`q4_gemv`; a model keeps its
#: dense weight for larger steps (why: ``benchmarks/results/quant_gpu``).
GEMV_MAX_M = 1
#: ... and up to this many :func:`q4_dot`; larger ones dequantize and matmul.
DOT_MAX_M = 128

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: 2**23: the float32 whose mantissa holds a small integer OR-ed into it.
_MAGIC_F32: tl.constexpr = tl.constexpr(8388608.0)
_MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B000000)
#: The GEMV scales x by 2**(_X_EXP - 4 s') before it meets a code read as a
#: subnormal float (see :func:`q4_gemv`), and d by 2**(149 - _X_EXP).
_X_EXP: tl.constexpr = tl.constexpr(88)
_D_SCALE: tl.constexpr = tl.constexpr(2.0 ** (149 - 88))


class GemvConfig(NamedTuple):
    """A launch of :func:`q4_gemv`: output rows per program, blocks of 32
    features per loop step, warps, whether each loop step loads the next
    step's words before it computes (double buffering in registers), and the
    loop's pipeline depth (Triton's ``num_stages``: above 1, the loads of
    later steps go to shared memory ahead, by asynchronous copies)."""

    block_n: int = 8
    block_g: int = 32
    num_warps: int = 4
    prefetch: bool = True
    stages: int = 1


# -- packing -----------------------------------------------------------------


def pack_q4(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales)`` in the module's layout for ``w = codes * scale +
    offset``: ``codes`` ``[N, K]`` integers in [0, 15], ``scale`` and
    ``offset`` ``[N, K // 32]`` (rounded to float16). On ``codes``' device."""
    if codes.dim() != 2 or codes.shape[1] % GROUP_SIZE:
        raise ValueError(f"codes must be [N, K] with K a multiple of 32, got {tuple(codes.shape)}")
    n, k = codes.shape
    groups = k // GROUP_SIZE
    if scale.shape != (n, groups) or offset.shape != (n, groups):
        raise ValueError(
            f"scale {tuple(scale.shape)} and offset {tuple(offset.shape)} must be ({n}, {groups})"
        )
    # Feature 4 s + t of a block -> [s, t]; byte 4 t + c holds s = 2c (low), 2c + 1 (high).
    by_position = codes.reshape(n, groups, 8, 4).to(torch.uint8)
    low, high = by_position[:, :, 0::2], by_position[:, :, 1::2]  # [n, groups, c, t]
    qweight = (low | (high << 4)).transpose(2, 3).reshape(n, k // 2).contiguous()
    scales = torch.stack([scale, offset], dim=-1).to(torch.float16).contiguous()
    return qweight, scales


def dequantize_q4_reference(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of ``(qweight, scales)`` (torch ops)."""
    n, half_k = qweight.shape
    groups = half_k * 2 // GROUP_SIZE
    by_byte = qweight.reshape(n, groups, 4, 4)  # [n, groups, t, c]
    nibbles = torch.stack([by_byte & 15, by_byte >> 4], dim=-1)  # [..., t, c, low/high]
    codes = nibbles.reshape(n, groups, 4, 8).transpose(2, 3).float()  # [n, groups, s, t]
    d, m = scales.float().unbind(-1)
    w = codes.reshape(n, groups, GROUP_SIZE) * d.unsqueeze(-1) + m.unsqueeze(-1)
    return w.reshape(n, groups * GROUP_SIZE)


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales)`` in the 8-bit layout (the module's docstring) for
    ``w = codes * scale``: ``codes`` ``[N, K]`` integers in [-128, 127],
    ``scale`` ``[N, K // 32]`` (rounded to float16). On ``codes``' device."""
    if codes.dim() != 2 or codes.shape[1] % GROUP_SIZE:
        raise ValueError(f"codes must be [N, K] with K a multiple of 32, got {tuple(codes.shape)}")
    n, k = codes.shape
    groups = k // GROUP_SIZE
    if scale.shape != (n, groups):
        raise ValueError(f"scale {tuple(scale.shape)} must be ({n}, {groups})")
    # Feature 8 s + t of a block -> byte 4 t + s (byte s of word t).
    by_position = (codes.reshape(n, groups, 4, 8) + 128).to(torch.uint8)
    qweight = by_position.transpose(2, 3).reshape(n, k).contiguous()
    d = scale.to(torch.float16)
    scales = torch.stack([d, d * -128], dim=-1).contiguous()
    return qweight, scales


def dequantize_q8_reference(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of an 8-bit ``(qweight, scales)`` (torch ops)."""
    n, k = qweight.shape
    groups = k // GROUP_SIZE
    codes = qweight.reshape(n, groups, 8, 4).transpose(2, 3).float()  # [n, groups, s, t]
    d, m = scales.float().unbind(-1)
    w = codes.reshape(n, groups, GROUP_SIZE) * d.unsqueeze(-1) + m.unsqueeze(-1)
    return w.reshape(n, k)


def _check_weight(qweight: torch.Tensor, scales: torch.Tensor, bits: int = 4) -> tuple[int, int]:
    """``(N, blocks per row)`` of a checked ``(qweight, scales)`` pair of
    ``bits``-bit codes."""
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or not qweight.is_contiguous():
        raise ValueError(
            f"qweight must be a contiguous uint8 [N, K * {bits} / 8], got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    n, row_bytes = qweight.shape
    block_bytes = GROUP_SIZE * bits // 8
    if row_bytes % block_bytes:
        raise ValueError(f"qweight's row of {row_bytes} bytes must be a multiple of {block_bytes}")
    groups = row_bytes // block_bytes
    if scales.shape != (n, groups, 2) or scales.dtype != torch.float16:
        raise ValueError(
            f"scales must be float16 ({n}, {groups}, 2), got {scales.dtype} {tuple(scales.shape)}"
        )
    if not scales.is_contiguous():
        raise ValueError("scales must be contiguous")
    if qweight.device != scales.device:
        raise ValueError(f"qweight on {qweight.device}, scales on {scales.device}")
    return n, groups


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


# -- kernels -----------------------------------------------------------------


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


#: The GEMV's prologue (what it makes of the rows it reads): x as it is,
#: ``rms_norm(x) * weight`` (the norm's scale applied to the dot products),
#: or ``silu(gate) * up`` of ``[gate | up]`` rows.
PROLOGUE_NONE: tl.constexpr = tl.constexpr(0)
PROLOGUE_RMS_NORM: tl.constexpr = tl.constexpr(1)
PROLOGUE_SILU_AND_MUL: tl.constexpr = tl.constexpr(2)


@triton.jit
def _load_x_in(  # type: ignore[no-untyped-def]
    x_at, nw_at, x_half, mask, EVEN: tl.constexpr, PROLOGUE: tl.constexpr
):
    """The GEMV's input at ``x_at`` in float32, through the prologue:
    ``(x, r)`` with ``r`` the raw value whose square the RMS norm sums.
    RMS_NORM: ``x * weight`` (the weight at ``nw_at``); SILU_AND_MUL:
    ``silu(gate) * up`` (up ``x_half`` elements on), rounded to x's dtype
    as :func:`asyncstep.gpu.triton_fused.silu_and_mul` stores it."""
    xv = _load_x(x_at, mask, EVEN)
    r = xv
    if PROLOGUE == PROLOGUE_RMS_NORM:
        xv = xv * _load_x(nw_at, mask, EVEN)
    elif PROLOGUE == PROLOGUE_SILU_AND_MUL:
        up = _load_x(x_at + x_half, mask, EVEN)
        xv = (xv / (1.0 + tl.exp(-xv)) * up).to(x_at.dtype.element_ty).to(tl.float32)
    return xv, r


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    qw_ptr,
    sm_ptr,
    out_ptr,
    nw_ptr,
    res_ptr,
    M,
    N,
    K_GROUPS,
    stride_xm,
    stride_om,
    stride_rm,
    eps,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN: tl.constexpr,
    STAGES: tl.constexpr,
    PROLOGUE: tl.constexpr = 0,
    RESIDUAL: tl.constexpr = False,
):
    # A block is BITS words; code s (bits BITS s ..) of word t is feature
    # BITS s + t. A code masked in place (for the top byte: in the word shifted
    # right by 8) read as a float32 is code * 2**(p - 149), p its bit offset
    # (every bit pattern below 2**24 is its integer times 2**-149), so one AND
    # makes the multiplicand; x, scaled by 2**(X_EXP - p), brings the product
    # to code * x * 2**(X_EXP - 149), and d carries 2**(149 - X_EXP).
    CODES: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # Unmasked x: every block inside, and one row a program (a program per row).
    X_EVEN: tl.constexpr = EVEN and BLOCK_M == 1
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    n64 = n.to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, BITS)
    m_idx = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_G], dtype=tl.float32)
    # RMS_NORM: each row's sum of squares, per block (every program reads the
    # whole row of x anyway); the norm's scale multiplies the dot products.
    sq_acc = tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.float32)
    x_half = K_GROUPS * 32  # SILU_AND_MUL: up follows gate
    if PREFETCH:
        words_next, sm_next = _load_chunk(
            qw_ptr, sm_ptr, n64, n_mask, 0, K_GROUPS, BLOCK_G, BITS, EVEN
        )
    for g0 in tl.range(0, K_GROUPS, BLOCK_G, num_stages=STAGES):
        gg = g0 + g
        g_mask = gg < K_GROUPS
        if PREFETCH:
            # This chunk's words were loaded an iteration ago; the next one's load now
            # (EVEN: the last step loads the first chunk again rather than past the end).
            words = words_next
            sm = sm_next
            if EVEN:  # noqa: SIM108 (a compile-time branch)
                g_next = tl.where(g0 + BLOCK_G < K_GROUPS, g0 + BLOCK_G, 0)
            else:
                g_next = g0 + BLOCK_G
            words_next, sm_next = _load_chunk(
                qw_ptr, sm_ptr, n64, n_mask, g_next, K_GROUPS, BLOCK_G, BITS, EVEN
            )
        else:
            words, sm = _load_chunk(qw_ptr, sm_ptr, n64, n_mask, g0, K_GROUPS, BLOCK_G, BITS, EVEN)
        d, m = _fp16_pair(sm)  # [BN, BG]
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
            xv, xr = _load_x_in(x_row, nw_row, x_half, x_mask, X_EVEN, PROLOGUE)
            xsum = xv
            xsq = xr * xr
            dots = (words & MASK).to(tl.float32, bitcast=True) * (xv * (2.0**_X_EXP))
            for s in tl.static_range(1, CODES):
                xv, xr = _load_x_in(
                    x_row + BITS * s, nw_row + BITS * s, x_half, x_mask, X_EVEN, PROLOGUE
                )
                xsum += xv
                xsq += xr * xr
                if BITS * (s + 1) <= 24:
                    bits = words & (MASK << (BITS * s))
                    xv = xv * (2.0 ** (_X_EXP - BITS * s))
                else:
                    bits = high & (MASK << (BITS * s - 8))
                    xv = xv * (2.0 ** (_X_EXP - BITS * s + 8))
                dots += bits.to(tl.float32, bitcast=True) * xv
            part = tl.sum(dots, axis=2) * d + m * tl.sum(xsum, axis=2)
            if BLOCK_M == 1:
                acc += part[None, :, :]
            else:
                acc = tl.where((m_idx == mi)[:, None, None], acc + part[None, :, :], acc)
            if PROLOGUE == PROLOGUE_RMS_NORM:
                sq = tl.sum(xsq, axis=2)  # [1, BG]
                if BLOCK_M == 1:
                    sq_acc += sq
                else:
                    sq_acc = tl.where((m_idx == mi)[:, None], sq_acc + sq, sq_acc)
    out = tl.sum(acc, axis=2)
    if PROLOGUE == PROLOGUE_RMS_NORM:
        inv_rms = tl.rsqrt(tl.sum(sq_acc, axis=1) / (K_GROUPS * 32) + eps)
        out = out * inv_rms[:, None]
    rows = pid_m * BLOCK_M + m_idx
    out_mask = (rows < M)[:, None] & n_mask[None, :]
    if RESIDUAL:
        # As the unfused layer: the product rounded to the output's dtype,
        # then the residual added in float32 and rounded again.
        res = tl.load(
            res_ptr + rows.to(tl.int64)[:, None] * stride_rm + n64[None, :],
            mask=out_mask,
            other=0.0,
        )
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + n64[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


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


# -- launchers ---------------------------------------------------------------


def _empty_out(x2: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((x2.shape[0], n), dtype=x2.dtype, device=x2.device)


def _gemv_config(n: int, groups: int, bits: int) -> GemvConfig:
    """The launch for an ``[n, 32 groups]`` weight of ``bits``-bit codes
    (picked by measurement on llama-8b's shapes, ``benchmarks/quant_gpu.py``):
    two warps whose lanes go along a row's blocks, 64 blocks a loop step, 8
    rows a thread (4-bit) or 32 blocks (8-bit); a long row (>= 256 blocks)
    loads the next step's words ahead."""
    if bits == 8:
        return GemvConfig(block_n=8, block_g=32, num_warps=2, prefetch=False)
    return GemvConfig(block_n=8, block_g=64, num_warps=2, prefetch=groups >= 256)


def _gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    config: GemvConfig | None,
    *,
    rms_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_and_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    n, groups = _check_weight(qweight, scales, bits)
    k = groups * GROUP_SIZE
    if rms_norm_weight is not None and silu_and_mul:
        raise ValueError("one prologue at a time: rms_norm_weight or silu_and_mul")
    x2 = _check_x(x, 2 * k if silu_and_mul else k, qweight.device)
    prologue = PROLOGUE_NONE.value
    nw = x2
    if rms_norm_weight is not None:
        if rms_norm_weight.shape != (k,) or rms_norm_weight.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"rms_norm_weight must be a float ({k},), got {rms_norm_weight.dtype} "
                f"{tuple(rms_norm_weight.shape)}"
            )
        if rms_norm_weight.device != qweight.device:
            raise ValueError(
                f"rms_norm_weight on {rms_norm_weight.device}, weight on {qweight.device}"
            )
        prologue, nw = PROLOGUE_RMS_NORM.value, rms_norm_weight.contiguous()
    elif silu_and_mul:
        prologue = PROLOGUE_SILU_AND_MUL.value
    out = _empty_out(x2, n)
    res = out
    if residual is not None:
        res = residual.reshape(-1, n) if residual.numel() == out.numel() else residual
        if res.shape != out.shape or res.dtype != x2.dtype or res.device != out.device:
            raise ValueError(
                f"residual must be {x2.dtype} {tuple(out.shape)} on {out.device}, got "
                f"{res.dtype} {tuple(res.shape)} on {res.device}"
            )
        if n > 1 and res.stride(1) != 1:
            res = res.contiguous()
    rows = x2.shape[0]
    if rows and n:
        cfg = config or _gemv_config(n, groups, bits)
        block_m = min(triton.next_power_of_2(rows), 4)
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(rows, block_m))
        _gemv_kernel[grid](
            x2,
            qweight.view(torch.int32),
            scales.view(torch.int32),
            out,
            nw,
            res,
            rows,
            n,
            groups,
            x2.stride(0),
            out.stride(0),
            res.stride(0),
            float(eps),
            BITS=bits,
            BLOCK_M=block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_G=cfg.block_g,
            PREFETCH=cfg.prefetch,
            EVEN=n % cfg.block_n == 0 and groups % cfg.block_g == 0,
            STAGES=cfg.stages,
            PROLOGUE=prologue,
            RESIDUAL=residual is not None,
            num_warps=cfg.num_warps,
        )
    return out.reshape(*x.shape[:-1], n)


def q4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    rms_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu_and_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T`` by streaming the packed 4-bit weight (see the module's
    docstring); any number of rows, meant for a few (a program unrolls up to
    4 rows of ``x`` over one read of its weights).

    The fused decode's forms (the layer's elementwise kernels folded in; at
    most one prologue):

    - ``rms_norm_weight``: ``rms_norm(x, eps) * rms_norm_weight`` in place of
      ``x`` (x ``[..., K]``): each program sums the squares of the row it
      reads and scales its dot products by the norm's ``1 / rms`` (the
      normed row is never rounded to x's dtype);
    - ``silu_and_mul``: ``silu(gate) * up`` in place of ``x`` (x ``[..., 2 K]``,
      gate then up), rounded to x's dtype as the unfused kernel stores it;
    - ``residual`` (x's dtype, the output's shape): returns ``residual +
      product``, the product rounded to x's dtype first, then the sum (as
      the unfused layer's add: the new residual stream).
    """
    return _gemv(
        x,
        qweight,
        scales,
        4,
        config,
        rms_norm_weight=rms_norm_weight,
        eps=eps,
        silu_and_mul=silu_and_mul,
        residual=residual,
    )


def q8_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    config: GemvConfig | None = None,
    *,
    rms_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """:func:`q4_gemv` for the 8-bit layout (the RMS-norm prologue only)."""
    return _gemv(x, qweight, scales, 8, config, rms_norm_weight=rms_norm_weight, eps=eps)


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
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in ``x``'s dtype, by the path that suits the
    number of rows (see the module's docstring)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows <= GEMV_MAX_M:
        y = q4_gemv(x, qweight, scales)
    elif rows <= DOT_MAX_M:
        y = q4_dot(x, qweight, scales)
    else:
        _check_x(x, qweight.shape[1] * 2, qweight.device)
        return F.linear(x, dequantize_q4(qweight, scales, x.dtype), bias)
    return y if bias is None else y + bias


def q8_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for the 8-bit layout, in ``x``'s dtype: the GEMV
    up to :data:`GEMV_MAX_M` rows, else the weight dequantized (torch ops) and
    ``torch``'s matmul."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows <= GEMV_MAX_M:
        y = q8_gemv(x, qweight, scales)
        return y if bias is None else y + bias
    _check_weight(qweight, scales, 8)
    _check_x(x, qweight.shape[1], qweight.device)
    return F.linear(x, dequantize_q8_reference(qweight, scales).to(x.dtype), bias)
