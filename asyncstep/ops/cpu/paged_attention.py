"""The CPU library's attention op: one call of ``cpu_kernels.c``'s paged
attention per layer and step rotates q and k (from the rotary's cache, at
the step's positions), stores the keys and values and attends every request
in place; padding rows of the output are zeros.

A layer with attention sinks (gpt-oss) is not the kernel's: the op rotates
q and k with torch and runs the reference attention
(:func:`~asyncstep.ops.torch_attention.reference_attention`, without the
decode plan, which this op set's steps do not make) for it.

May import torch and :mod:`asyncstep.ops`' attention metadata and CPU library.
"""

from __future__ import annotations

import torch

from asyncstep.ops.attention import AttentionMetadata, AttentionShape
from asyncstep.ops.cpu.attention import CpuPagedAttention, CpuStepArgs
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.torch_attention import reference_attention, write_kv_cache

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
    #: Through the reference (the module's docstring).
    supports_sinks = True

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
        if shape.sinks is not None:
            return _reference_with_sinks(q, k, v, kv_cache, meta, shape, cos_sin_cache)
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
        )
        return out


def _reference_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    shape: AttentionShape,
    cos_sin_cache: torch.Tensor | None,
) -> torch.Tensor:
    """A layer with sinks: torch's rotary (where the layer has one), the
    reference's KV store and attention; padding rows zeros."""
    from asyncstep.ops.torch_ref import TORCH_OPS

    n, total = meta.num_actual_tokens, q.shape[0]
    q, k, v = q[:n], k[:n], v[:n]
    if cos_sin_cache is not None:
        assert meta.positions is not None, "a rotating attention op needs the step's positions"
        cos_sin = TORCH_OPS.rotary_cos_sin(cos_sin_cache, meta.positions[:n], q.dtype)
        q, k = TORCH_OPS.rotary(cos_sin, q, k, cos_sin_cache, shape.head_dim)
    q = q.reshape(n, shape.num_heads, shape.head_dim)
    k = k.reshape(n, shape.num_kv_heads, shape.head_dim)
    v = v.reshape(n, shape.num_kv_heads, shape.head_dim)
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    attended = reference_attention(
        q, k, v, kv_cache, meta, shape.scale, shape.sliding_window, shape.sinks, planned=False
    )
    out = attended.new_zeros(total, shape.num_heads * shape.head_dim)
    out[:n] = attended.reshape(n, -1)
    return out
