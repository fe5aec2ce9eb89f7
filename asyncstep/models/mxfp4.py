"""MXFP4 (OCP microscaling FP4), as gpt-oss's checkpoints store their
experts: each 32 consecutive values of a row share one power-of-two scale.

A projection ``W`` ``[..., rows, cols]`` is stored as ``{name}_blocks``
uint8 ``[..., rows, cols / 32, 16]`` (two FP4 E2M1 codes a byte: the low
nibble is the even column, the high nibble the odd one) and
``{name}_scales`` uint8 ``[..., rows, cols / 32]`` (E8M0: the exponent
``scale - 127``). A code's 4 bits are sign, 2 exponent bits and 1 mantissa
bit: ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives
(:data:`FP4_VALUES`, transformers' ``integrations/mxfp4.py``). Value =
``FP4_VALUES[code] * 2 ** (scale - 127)``.

gpt-oss stores ``gate_up_proj`` as ``[E, 2I, H]`` rows (interleaved gate
and up rows, each row over H) and ``down_proj`` as ``[E, H, I]``: the
transpose of the unquantized checkpoint's ``[E, H, 2I]`` / ``[E, I, H]``;
:func:`dequantize_mxfp4` returns the stored ``[..., rows, cols]``.

Memory: MXFP4 is 4.25 bits a value (0.5 byte + 1 byte per 32 values), a
dequantized bfloat16 copy 16 bits: :func:`mxfp4_bytes`. gpt-oss-20b's
experts (24 layers x 32 experts x (5760 + 2880) x 2880 = 19.1e9 values) are
10.2 GB packed and 38.2 GB as bfloat16 (float32: 76.4 GB).

gpt-oss's loader (:meth:`asyncstep.models.gpt_oss.GptOssForCausalLM.load_weights`)
keeps the experts packed where the CPU library computes on them (float32
on the CPU: :class:`~asyncstep.ops.mxfp4.Mxfp4Weight`, the kernel's
layout), else dequantizes each projection once at load to the model's
dtype (:func:`dequantize_mxfp4`).

May import torch.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK_SIZE", "FP4_VALUES", "dequantize_mxfp4", "mxfp4_bytes"]

#: Values sharing one scale.
BLOCK_SIZE = 32
#: FP4 E2M1 code -> value.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
#: E8M0's exponent bias.
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``blocks`` uint8 ``[..., rows, G, 16]`` and ``scales`` uint8 ``[...,
    rows, G]`` as ``[..., rows, G * 32]`` of ``dtype`` (exact: every value
    is a small power-of-two multiple of a code, within float32's and, for
    exponents in bfloat16's range, bfloat16's). ValueError for other shapes
    or dtypes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4: blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + (16,)"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-3)  # [..., rows, G * 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    exponents = exponents.repeat_interleave(BLOCK_SIZE, dim=-1)
    return torch.ldexp(values, exponents.float()).to(dtype)


def mxfp4_bytes(num_values: int) -> int:
    """Bytes of ``num_values`` (a multiple of 32) as MXFP4: codes and scales."""
    return num_values // 2 + num_values // BLOCK_SIZE
