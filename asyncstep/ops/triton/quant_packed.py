"""Packed integer math for the Q4 / Q8 GEMV (:mod:`asyncstep.ops.triton.quant_kernels`):
x quantized per block of 32 features to int8 (llama.cpp's Q8_1 activations),
four codes times four int8 x's summed by one ``dp4a``.

A block's x (its 32 floats, in the tiles the GEMV loads) becomes
``dx * qx``: ``dx = max|x| / 127``, ``qx = round(x / dx)`` in [-127, 127]
(half to even; a block whose largest ``|x|`` is under 1e-30 reads as
zeros). The codes of a Q4 word ``t`` (nibble ``s``: feature ``4 s + t``)
meet the int8 x's without a shift: ``word & 0x0F0F0F0F`` holds the even
nibbles ``s = 0, 2, 4, 6`` as bytes, ``word & 0xF0F0F0F0`` the odd ones
times 16; x is packed to match (four int8 a word, features ``4 s + t`` of
the same ``s``), so a word costs two ANDs and two ``dp4a``. A Q8 word (byte
``s``: feature ``8 s + t``, the code plus 128) is one ``dp4a`` as it is.
Each block's integer sum, scaled by ``d * dx``, plus ``m * dx * sum(qx)``,
is the block's product: ``sum((q d + m) dx qx)``, the dequantized weight
times the quantized x, in float32 from there on.

On CUDA ``dp4a`` and the byte packing are PTX (``dp4a.u32.s32``,
``prmt.b32``); under the Triton interpreter (``ASM`` false) the same
arithmetic in plain integer ops.

May import triton only.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: 1.5 * 2**23: x * (127 / max|x|) + this, read as int32, holds the rounded
#: code in its low byte (two's complement).
_ROUND_F32: tl.constexpr = tl.constexpr(12582912.0)
#: Four bytes of 1: ``dp4a(ONES, x)`` is the sum of x's four int8s.
_ONES: tl.constexpr = tl.constexpr(0x01010101)
_LOW_NIBBLES: tl.constexpr = tl.constexpr(0x0F0F0F0F)
#: 0xF0F0F0F0 as an int32.
_HIGH_NIBBLES: tl.constexpr = tl.constexpr(0xF0F0F0F0 - (1 << 32))
#: Blocks whose largest |x| is below this read as zeros (127 / it stays finite).
_TINY: tl.constexpr = tl.constexpr(1e-30)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """``c + sum_j a_j b_j`` over the four bytes of int32 ``a`` (unsigned) and
    ``b`` (signed), in int32 (broadcast)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, c],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        acc = c + 0 * (a + b)
        for j in tl.static_range(4):
            acc += ((a >> (8 * j)) & 255) * ((b << (24 - 8 * j)) >> 24)
        return acc


@triton.jit
def _pack_bytes(b0, b1, b2, b3, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The low bytes of four int32s as one int32 (``b0``'s lowest)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1; prmt.b32 t0, $1, $2, 0x0040; prmt.b32 t1, $3, $4, 0x0040; "
            "prmt.b32 $0, t0, t1, 0x5410; }",
            "=r,r,r,r,r",
            [b0, b1, b2, b3],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        return (b0 & 255) | ((b1 & 255) << 8) | ((b2 & 255) << 16) | (b3 << 24)


@triton.jit
def _code(x, inv):  # type: ignore[no-untyped-def]
    """``round(x * inv)`` (half to even) in the low byte of an int32."""
    return (x * inv + _ROUND_F32).to(tl.int32, bitcast=True)


@triton.jit
def _scale_of(amax):  # type: ignore[no-untyped-def]
    """``(127 / amax, amax / 127)`` of a block's largest |x| (both 0 below _TINY)."""
    big = amax > _TINY
    inv = tl.where(big, 127.0 / tl.where(big, amax, 1.0), 0.0)
    return inv, tl.where(big, amax / 127.0, 0.0)


@triton.jit
def _quarters(v):  # type: ignore[no-untyped-def]
    """``v[..., 0]`` .. ``v[..., 3]`` of a ``[.., 4]`` tensor (a thread's own words)."""
    shape: tl.constexpr = v.shape
    even, odd = tl.split(tl.reshape(v, [shape[0], shape[1], 2, 2]))
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0, v1, v2, v3


@triton.jit
def _q4_block_dot(acc, words, d, m, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """``acc`` plus each row's product with one block of x, per block:
    ``words`` int32 ``[BN, BG, 4]`` Q4 words, ``d``, ``m``, ``acc`` float32
    ``[BN, BG]``, ``xs`` float32 ``[1, BG, 4]``: features ``4 s + t`` of each
    block (``x<s>[.., t]``)."""
    amax = tl.maximum(
        tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
        tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))),
    )
    inv, dx = _scale_of(tl.max(amax, axis=2))  # [1, BG]
    inv3 = inv[:, :, None]
    even = _pack_bytes(_code(x0, inv3), _code(x2, inv3), _code(x4, inv3), _code(x6, inv3), ASM)
    odd = _pack_bytes(_code(x1, inv3), _code(x3, inv3), _code(x5, inv3), _code(x7, inv3), ASM)
    x_sum = tl.sum(_dp4a(_ONES, even, _dp4a(_ONES, odd, 0, ASM), ASM), axis=2)  # [1, BG]
    w0, w1, w2, w3 = _quarters(words)
    e0, e1, e2, e3 = _quarters(even)
    o0, o1, o2, o3 = _quarters(odd)
    # The even nibbles' sum, times 16, then the odd ones' (16 q each): 16 sum(q qx).
    dots = _dp4a(w0 & _LOW_NIBBLES, e0, 0, ASM)
    dots = _dp4a(w1 & _LOW_NIBBLES, e1, dots, ASM)
    dots = _dp4a(w2 & _LOW_NIBBLES, e2, dots, ASM)
    dots = _dp4a(w3 & _LOW_NIBBLES, e3, dots, ASM) * 16
    dots = _dp4a(w0 & _HIGH_NIBBLES, o0, dots, ASM)
    dots = _dp4a(w1 & _HIGH_NIBBLES, o1, dots, ASM)
    dots = _dp4a(w2 & _HIGH_NIBBLES, o2, dots, ASM)
    dots = _dp4a(w3 & _HIGH_NIBBLES, o3, dots, ASM)
    return acc + dots.to(tl.float32) * (dx * 0.0625) * d + m * (dx * x_sum.to(tl.float32))


@triton.jit
def _q8_block_dot(acc, words, d, m, x0, x1, x2, x3, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """:func:`_q4_block_dot` for Q8 words (``[BN, BG, 8]``; ``xs`` ``[1, BG,
    8]``: features ``8 s + t``)."""
    amax = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    inv, dx = _scale_of(tl.max(amax, axis=2))
    inv3 = inv[:, :, None]
    xq = _pack_bytes(_code(x0, inv3), _code(x1, inv3), _code(x2, inv3), _code(x3, inv3), ASM)
    dots = tl.sum(_dp4a(words, xq, 0, ASM), axis=2).to(tl.float32)
    x_sum = tl.sum(_dp4a(_ONES, xq, 0, ASM), axis=2).to(tl.float32)
    return acc + dots * dx * d + m * (dx * x_sum)
