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


#: The GEMV's prologue (what it makes of the rows it reads): x as it is;
#: ``rms_norm(x) * weight`` (RMS_NORM: each program sums the squares of the
#: row it reads, the norm's scale applied to the dot products); or x already
#: multiplied by the norm's weight, the squares of the raw row summed in
#: parts by the kernel that wrote it (NORMED: see the NEXT_NORM epilogue).
PROLOGUE_NONE: tl.constexpr = tl.constexpr(0)
PROLOGUE_RMS_NORM: tl.constexpr = tl.constexpr(1)
PROLOGUE_NORMED: tl.constexpr = tl.constexpr(2)


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
    rows = pid_m * BLOCK_M + m_idx
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_G], dtype=tl.float32)
    # RMS_NORM: each row's sum of squares, per block (every program reads the
    # whole row of x anyway); the norm's scale multiplies the dot products.
    sq_acc = tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.float32)
    if PROLOGUE == PROLOGUE_NORMED:  # the parts' loads ahead of the loop
        parts = tl.arange(0, SQ_BLOCK)
        sq_parts = tl.load(
            sq_ptr + rows.to(tl.int64)[:, None] * stride_sq + parts[None, :],
            mask=(rows < M)[:, None] & (parts < n_sq_parts)[None, :],
            other=0.0,
        )
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
            xr = _load_x(x_row, x_mask, X_EVEN)
            xsq = xr * xr
            if PROLOGUE == PROLOGUE_RMS_NORM:  # noqa: SIM108 (a compile-time branch)
                xv = xr * _load_x(nw_row, x_mask, X_EVEN)
            else:
                xv = xr
            xsum = xv
            dots = (words & MASK).to(tl.float32, bitcast=True) * (xv * (2.0**_X_EXP))
            for s in tl.static_range(1, CODES):
                xr = _load_x(x_row + BITS * s, x_mask, X_EVEN)
                xsq += xr * xr
                if PROLOGUE == PROLOGUE_RMS_NORM:
                    xv = xr * _load_x(nw_row + BITS * s, x_mask, X_EVEN)
                else:
                    xv = xr
                xsum += xv
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
    cfg = config or _gemv_config(n, groups, bits)
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
            num_warps=cfg.num_warps,
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
) -> torch.Tensor:
    """``x @ w.T`` by streaming the packed 4-bit weight (see the module's
    docstring); any number of rows, meant for a few (a program unrolls up to
    4 rows of ``x`` over one read of its weights)."""
    return _gemv(x, qweight, scales, 4, config)[0]


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
      (``[M, N / 2]``), each rounded as :func:`asyncstep.gpu.triton_fused.silu_and_mul`
      reads and stores them;
    - ``next_rms_norm_weight`` (``[N]``): also the :class:`NormedRows` of
      ``out`` for the RMS norm of that weight, which the next GEMV folds in
      with ``sq_parts``.
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
    )


def interleave_pairs(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A ``[2 d, K]`` packed weight of two stacked halves (gate rows, then up
    rows) with rows ``2 j, 2 j + 1`` the halves' rows ``j`` (new tensors)."""
    n = qweight.shape[0]
    if n % 2:
        raise ValueError(f"an odd row count ({n}) has no halves")
    order = torch.arange(n, device=qweight.device).view(2, n // 2).T.reshape(n)
    return qweight[order].contiguous(), scales[order].contiguous()


def q8_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """:func:`q4_gemv` for the 8-bit layout."""
    return _gemv(x, qweight, scales, 8, config)[0]


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
