"""MXFP4 dequantization (gpt-oss's experts) against a bit-level reference
decode of each E2M1 code and E8M0 scale, and transformers' own
``convert_moe_packed_tensors``; the bytes of gpt-oss-20b's experts packed
and dequantized."""

from __future__ import annotations

import math

import pytest
import torch

from asyncstep.models.dummy import get_shape
from asyncstep.models.mxfp4 import dequantize_mxfp4, mxfp4_bytes


def decode_e2m1(code: int) -> float:
    """Sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, groups, _ = blocks.shape
    out = torch.empty(rows, groups * 32, dtype=torch.float64)
    for r in range(rows):
        for g in range(groups):
            for b in range(16):
                byte = int(blocks[r, g, b])
                for nibble, code in enumerate((byte & 0xF, byte >> 4)):
                    value = decode_e2m1(code) * 2.0 ** (int(scales[r, g]) - 127)
                    out[r, g * 32 + 2 * b + nibble] = value
    return out


def packed(seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_matches_the_bit_level_decode() -> None:
    blocks, scales = packed(0, (5, 3))
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(got.double(), reference(blocks, scales))
    assert torch.equal(dequantize_mxfp4(blocks, scales), got.bfloat16())  # exact in bf16 too


def test_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = packed(1, (2, 6, 4))  # [E, rows, groups]
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_bad_shapes_are_refused() -> None:
    blocks, scales = packed(2, (4, 2))
    with pytest.raises(ValueError, match="must be scales"):
        dequantize_mxfp4(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales)


def test_gpt_oss_20b_expert_bytes() -> None:
    arch = get_shape("gpt-oss-20b")
    per_layer = arch.num_experts * 3 * arch.moe_intermediate_size * arch.hidden_size
    values = arch.num_hidden_layers * per_layer
    assert math.isclose(values, 19.11e9, rel_tol=1e-3)
    assert math.isclose(mxfp4_bytes(values), 10.15e9, rel_tol=1e-3)
    assert math.isclose(2 * values, 38.22e9, rel_tol=1e-3)  # bfloat16
