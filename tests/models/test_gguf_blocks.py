"""GGUF's Q4_0 / Q4_1 / Q8_0 / MXFP4 dequantized with torch (``loader/gguf_blocks``)
give gguf-py's values bit for bit; other types are left to gguf-py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from asyncstep.models.loader.gguf_blocks import dequantize_blocks

TYPES = [
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.MXFP4,
]


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_as_gguf_does(kind: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((24, 256)) * rng.uniform(1e-3, 10, (24, 1))).astype(np.float32)
    values[3, :32] = 0  # an all-zero block
    raw = gguf.quants.quantize(values, kind)
    theirs = np.ascontiguousarray(gguf.quants.dequantize(raw, kind), dtype=np.float32)
    ours = dequantize_blocks(raw, int(kind))
    assert ours is not None and ours.dtype == torch.float32
    assert torch.equal(
        ours.view(torch.int32), torch.from_numpy(theirs).reshape(-1).view(torch.int32)
    )


def test_other_types_are_left_to_gguf_py() -> None:
    values = np.ones((2, 64), dtype=np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q5_0)
    assert dequantize_blocks(raw, int(gguf.GGMLQuantizationType.Q5_0)) is None
    assert dequantize_blocks(np.zeros(35, np.uint8), int(TYPES[2])) is None  # not whole blocks
