"""Float32 weights as a GGUF's Q4_0 / Q4_1 / Q8_0 tensors dequantize (for
the packing tests): float16 scales (and Q4_1 minimums) per block of 32,
the codes that pin each block's grid present."""

from __future__ import annotations

import torch

BLOCK = 32


def q4_1_weight(rows: int, cols: int) -> torch.Tensor:
    """``d * q + m``, codes 0..15 with 0 and 15 in every block."""
    blocks = cols // BLOCK
    d = (torch.rand(rows, blocks, 1) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(rows, blocks, 1) * 0.1).half().float()
    q = torch.randint(0, 16, (rows, blocks, BLOCK)).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(rows, cols)


def q4_0_weight(rows: int, cols: int) -> torch.Tensor:
    """``d * (q - 8)``, code 0 at the block's largest magnitude (and no code
    15 in some blocks)."""
    blocks = cols // BLOCK
    d = (torch.rand(rows, blocks, 1) * 0.02 + 1e-3).half().float()
    q = torch.randint(0, 15, (rows, blocks, BLOCK)).float()
    q[..., 0] = 0
    return (d * (q - 8)).reshape(rows, cols)


def q8_0_weight(rows: int, cols: int) -> torch.Tensor:
    """``d * q``, |q| <= 127, 127 at the block's largest magnitude."""
    blocks = cols // BLOCK
    d = (torch.rand(rows, blocks, 1) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (rows, blocks, BLOCK)).float()
    q[..., 0] = 127
    return (d * q).reshape(rows, cols)
