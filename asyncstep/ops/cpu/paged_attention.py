"""The CPU library's attention op: one call of ``cpu_kernels.c``'s paged
attention per layer and step rotates q and k (from the rotary's cache, at
the step's positions), stores the keys and values and attends every request
in place; padding rows of the output are zeros. A layer's sliding window
and attention sinks (gpt-oss) go to the same call.

May import torch and :mod:`asyncstep.ops`' attention metadata and CPU library.
"""

from __future__ import annotations

import torch

from asyncstep.ops.attention import AttentionMetadata, AttentionShape
from asyncstep.ops.cpu.attention import CpuPagedAttention, CpuStepArgs
from asyncstep.ops.cpu.library import load_cpu_kernels

__all__ = ["CpuAttention", "cpu_step_args"]


def cpu_step_args(meta: AttentionMetadata) -> CpuStepArgs:
    """``meta`` as the CPU kernels read it (made once per step: the step's
    first layer keeps it in ``meta.kernel_args`` for the others)."""
    args = meta.kernel_args
    if not isinstance(args, CpuStepArgs):
        args = meta.kernel_args = CpuStepArgs.build(
            meta.num_actual_tokens,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            meta.slot_mapping,
            meta.positions,
        )
    return args


class CpuAttention:
    """The CPU kernel as an :class:`~asyncstep.ops.base.AttentionOp`."""

    name = "cpu"
    rotates = True
    plans_decodes = False
    supports_sliding_window = True
    supports_sinks = True
    norms_qk = False

    def __init__(self, kernel: CpuPagedAttention) -> None:
        self.kernel = kernel

    @classmethod
    def chosen(cls, *, fused_kernels: bool, fused_decode: bool) -> CpuAttention:
        """The op over the loaded library (which the choice checked builds;
        it always rotates: no option applies)."""
        kernels = load_cpu_kernels()
        assert kernels is not None, "the cpu attention op needs the CPU library"
        return cls(kernels.attention)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        shape: AttentionShape,
        cos_sin_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        out = q.new_empty(q.shape[0], shape.num_heads * shape.head_dim)
        if q.shape[0] > meta.num_actual_tokens:
            out[meta.num_actual_tokens :].zero_()
        step = cpu_step_args(meta)
        self.kernel(
            out,
            q,
            k,
            v,
            kv_cache,
            step,
            shape.scale,
            cos_sin_cache,
            sliding_window=shape.sliding_window,
            sinks=shape.sinks,
        )
        return out
