"""The weight formats a linear layer's packed copy takes, chosen once when
the weights load: the CPU library's Q4 / Q8 blocks
(:mod:`asyncstep.ops.cpu.quant`), torch's int4 / int8
(:mod:`asyncstep.ops.packed`), the GPU's Q4 / Q8
(:mod:`asyncstep.ops.triton.quant_weight`). Each format carries its own
matmul (:meth:`~asyncstep.ops.packed.PackedWeight.mm`), so a layer holding
one needs no flag; the loaders and the weight cache pack and rebuild them
here, never importing an implementation.

May import torch and :mod:`asyncstep.ops`' packed formats, CPU library and
Triton formats (on use: triton is optional).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncstep.ops.cpu.library import cpu_kernels_off
from asyncstep.ops.cpu.quant import CpuQuantWeight, pack_q4_cpu, pack_q8_cpu
from asyncstep.ops.packed import PackedWeight

__all__ = [
    "GPU_Q8_KIND",
    "cpu_kernels_off",
    "pack_cpu_blocks",
    "pack_gpu",
    "packed_from_layout",
    "packed_layout",
    "packed_shape_ok",
]

#: The kind of an 8-bit GPU weight (an LM head's).
GPU_Q8_KIND = "q8_gpu"


def pack_cpu_blocks(
    weight: torch.Tensor, dtype: torch.dtype, max_tokens: int, *, lm_head: bool
) -> PackedWeight | None:
    """``weight`` in the CPU library's blocks (Q4 for a decoder projection,
    Q8 for an LM head), or None where it is not exactly on their grid."""
    return (pack_q8_cpu if lm_head else pack_q4_cpu)(weight, dtype, max_tokens)


def pack_gpu(weight: torch.Tensor, *, lm_head: bool) -> PackedWeight | None:
    """``weight`` (float32, on its GPU) as Q4, or for an LM head Q8, for
    one-row steps; None where it is on neither grid."""
    from asyncstep.ops.triton.quant_weight import pack_q4_gpu, pack_q8_gpu

    packed: PackedWeight | None = pack_q4_gpu(weight)
    if packed is None and lm_head:
        packed = pack_q8_gpu(weight)
    return packed


def packed_layout(weight: PackedWeight) -> dict[str, Any]:
    """What rebuilds ``weight`` from its data and scales (the weight cache's entry)."""
    layout: dict[str, Any] = {
        "kind": weight.kind,
        "out_features": weight.out_features,
        "in_features": weight.in_features,
        "max_tokens": weight.max_tokens,
    }
    if isinstance(weight, CpuQuantWeight):
        layout["levels"] = weight.levels
    return layout


def packed_from_layout(
    layout: dict[str, Any], data: torch.Tensor, scales: torch.Tensor
) -> PackedWeight:
    """The packed weight :func:`packed_layout` described (ValueError: an unknown kind)."""
    kind, max_tokens = str(layout["kind"]), int(layout["max_tokens"])
    rows, cols = int(layout["out_features"]), int(layout["in_features"])
    if kind in CpuQuantWeight.KINDS:
        levels = int(layout["levels"])
        return CpuQuantWeight(kind, data, scales, rows, cols, max_tokens, levels)
    if kind in ("int4", "int8"):
        return PackedWeight(kind, data, scales, rows, cols, max_tokens)
    raise ValueError(f"unknown packed kind {kind!r}")


def packed_shape_ok(weight: PackedWeight) -> bool:
    """Whether ``weight``'s data and scales have its kind's shapes."""
    rows, cols = weight.out_features, weight.in_features
    if isinstance(weight, CpuQuantWeight):
        groups, blocks = -(-rows // 16), cols // 32
        return (
            weight.data.dtype == torch.uint8
            and weight.data.dim() == 3
            and tuple(weight.data.shape[:2]) == (groups, blocks)
            and weight.data.shape[2] == CpuQuantWeight.block_bytes(weight.kind)
        )
    if weight.kind == "int8":
        return tuple(weight.data.shape) == (rows, cols) and tuple(weight.scales.shape) == (rows,)
    return tuple(weight.scales.shape) == (cols // 32, rows, 2)  # int4: torch's layout
