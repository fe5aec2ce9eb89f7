"""GGUF's simple block types dequantized with torch (vectorized, on every
core) instead of gguf-py's numpy loop over row groups: Q4_0, Q4_1, Q8_0 and
MXFP4 (gpt-oss's experts: a block of 32 is one E8M0 scale byte, then 16
bytes of FP4 codes, value ``j`` in the low nibble of byte ``j`` and value
``j + 16`` in its high nibble; :mod:`asyncstep.models.mxfp4` has the codes'
values), bit for bit as ``gguf.quants.dequantize`` computes them (the same
float32 products and sums, in the same order). Other types: None (the
caller falls back to gguf-py). Imports numpy, torch and
:mod:`asyncstep.models.mxfp4`.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncstep.models.mxfp4 import FP4_VALUES

__all__ = ["dequantize_blocks"]

#: Bytes a block of 32 values: Q4_0 (d, 16 bytes of nibbles), Q4_1 (d, m,
#: nibbles), Q8_0 (d, 32 int8), MXFP4 (e, nibbles); GGML type ids.
_BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 39: 17}
BLOCK = 32
#: MXFP4's codes doubled (gguf-py's ``kvalues``: -0 is +0), as float32.
_FP4_DOUBLED = tuple(2 * v + 0.0 for v in FP4_VALUES)


def dequantize_blocks(data: np.ndarray, type_id: int) -> torch.Tensor | None:
    """The float32 values (flat) of ``data`` (a tensor's raw bytes) of GGML
    type ``type_id``, or None for a type this module does not take."""
    block_bytes = _BLOCK_BYTES.get(int(type_id))
    if block_bytes is None or data.dtype != np.uint8 or data.size % block_bytes:
        return None
    blocks = torch.from_numpy(np.array(data, copy=True).reshape(-1, block_bytes))
    if block_bytes == 17:
        return _mxfp4(blocks)
    d = _halves(blocks, 0)
    if block_bytes == 34:  # Q8_0: x * d
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).reshape(-1)
    nibbles = blocks[:, -16:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)  # values 0..15, then 16..31
    if block_bytes == 18:  # Q4_0: d * (q - 8)
        return (d * (codes.to(torch.int8) - 8).float()).reshape(-1)
    return (d * codes.float() + _halves(blocks, 2)).reshape(-1)  # Q4_1: d * q + m


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32 ``[blocks, 1]``."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks: ``2 ** (e - 128)`` (ggml's "half" E8M0 scale, subnormal
    for ``e < 2``) times the doubled code."""
    e = blocks[:, :1].to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    nibbles = blocks[:, 1:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).long()  # values 0..15, 16..31
    lut = torch.tensor(_FP4_DOUBLED, dtype=torch.float32)
    return (d * lut[codes]).reshape(-1)
