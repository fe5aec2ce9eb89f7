"""What both CPU decoder stacks (:mod:`~asyncstep.ops.cpu.decode_stack`,
:mod:`~asyncstep.ops.cpu.f32_stack`) hand their C side besides their
layers: the stage's input stream, its output tensors and the step's
attention metadata, as 8-byte fields in the order both argument structs
hold them (``hidden_in`` through ``num_threads``).

May import torch and :mod:`asyncstep.ops`' attention metadata and CPU attention.
"""

from __future__ import annotations

import torch

from asyncstep.ops.attention import AttentionMetadata
from asyncstep.ops.cpu.attention import TILE_ROWS
from asyncstep.ops.cpu.paged_attention import cpu_step_args

__all__ = ["stream_and_step"]


def stream_and_step(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    meta: AttentionMetadata,
    cos_sin_cache: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
) -> tuple[tuple[int | float, ...], torch.Tensor, torch.Tensor]:
    """``(fields, hidden_out, residual_out)``: the fields of ``hidden`` and
    ``residual`` (float32 rows of hidden's shape, or None), of two new
    outputs (``out_dtype`` and float32 rows of hidden's shape), of the step
    (``meta``'s CPU arguments: the stack rotates q and k at its positions,
    from ``cos_sin_cache``), the attention's query tokens a work item for
    ``group`` query heads a KV head, and torch's thread count. ValueError
    for a residual that does not fit."""
    rows, width = hidden.shape
    if residual is not None:
        if residual.dtype != torch.float32 or residual.shape != hidden.shape:
            raise ValueError("the residual must be float32 rows of the hidden states' shape")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    hidden_out = torch.empty(rows, width, dtype=out_dtype)
    residual_out = torch.empty(rows, width, dtype=torch.float32)
    step = cpu_step_args(meta)
    assert step.positions, "the stack rotates q and k: positions needed"
    fields = (
        hidden.data_ptr(),
        hidden.stride(0),
        0 if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        hidden_out.data_ptr(),
        residual_out.data_ptr(),
        step.slot_mapping,
        step.query_start_loc,
        step.seq_lens,
        step.num_reqs,
        step.block_table,
        step.block_table_stride,
        step.positions,
        cos_sin_cache.data_ptr(),
        max(1, TILE_ROWS // group),
        torch.get_num_threads(),
    )
    return fields, hidden_out, residual_out
