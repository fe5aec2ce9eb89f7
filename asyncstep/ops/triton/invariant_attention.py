"""The batch-invariant paged attention (issue 40) and its attention op.

:func:`invariant_paged_attention` takes :func:`~asyncstep.ops.triton.attention.paged_attention`'s
arguments and gives each query row the same bits whatever else is in the
step: a query at position p reduces over fixed splits of
:data:`SPLIT_KEYS` keys (the number of splits follows p, never the batch
nor the SM count) in one order, whether it comes as a decode, a verify
step's ``1 + k`` queries, a prompt chunk over a cached prefix or a whole
prompt (the order: :mod:`asyncstep.ops.triton.invariant_attention_kernels`).
The tile sizes are the query-tiled kernel's, from the model's shape only
(GQA group, head_dim, dtype). The launch is chosen from shapes only
(CUDA-graph safe, no host sync): a step whose scratch (``tokens x heads x
splits x head_dim`` float32, splits bounded by the block table's width)
fits :data:`MAX_SCRATCH_BYTES` runs one program per split and a combine
kernel (a decode batch keeps the GPU busy at any context length), larger
steps one program per query tile folding its splits in a loop; both give
the same bits. Attention sinks (gpt-oss) start each row's fold (the
fold's maximum the sink, its sum 1) before split 0, in both launches.

:class:`TritonInvariantAttention`: the KV store rotating q and k
(:func:`~asyncstep.ops.triton.rotary.rotary_and_store_kv`) then this
attention; no fused decode path (its split count depends on the batch).

May import torch, triton (on use) and :mod:`asyncstep.ops`' attention
metadata and Triton kernels.
"""

from __future__ import annotations

import torch

from asyncstep.ops.attention import AttentionMetadata, AttentionShape

__all__ = [
    "MAX_SCRATCH_BYTES",
    "SPLIT_KEYS",
    "TritonInvariantAttention",
    "invariant_paged_attention",
]

#: Keys per split (a multiple of every key tile).
SPLIT_KEYS = 256
#: The largest split scratch a step takes; larger steps fold in the tile programs.
MAX_SCRATCH_BYTES = 256 << 20

#: log2(e): the kernels compute exp(x) as exp2(x * log2(e)).
_LOG2E = 1.4426950408889634


def invariant_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    parallel: bool | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's queries over its keys in the paged
    cache, as :func:`~asyncstep.ops.triton.attention.paged_attention` (same
    arguments, same ValueErrors, padding rows zeros), each row's bits
    independent of the step's other rows. ``parallel``: force the split
    programs + combine (True) or the tile loop (False); None: by the
    scratch size. ``sliding_window`` and ``sinks``: as ``paged_attention``'s."""
    import triton

    from asyncstep.ops.triton import pdl
    from asyncstep.ops.triton.attention import (
        _attention_launch,
        _check_attention_args,
        sink_logits_of,
    )
    from asyncstep.ops.triton.invariant_attention_kernels import (
        _invariant_attention_kernel,
        _invariant_combine_kernel,
    )

    _check_attention_args(q, kv_cache, query_start_loc, seq_lens, block_table, None)
    sink_logits = sink_logits_of(sinks, q)
    sinks_arg = q if sink_logits is None else sink_logits  # unused without sinks
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    launch = _attention_launch(group, head_dim_pad, q.dtype)
    assert SPLIT_KEYS % launch.tile_n == 0
    splits = max(1, triton.cdiv(block_table.shape[1] * block_size, SPLIT_KEYS))
    scratch = num_tokens * num_heads * splits * (head_dim_pad + 1) * 4
    if parallel is None:
        parallel = scratch <= MAX_SCRATCH_BYTES
    if parallel:
        part = torch.empty(
            (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride(), lse.stride()[:2]
    else:  # unused
        part, lse = out, out
        part_strides, lse_strides = (0, 0, 0, 0), (0, 0)
    tiles = num_tokens // launch.block_q + num_reqs + 1
    _invariant_attention_kernel[(tiles, num_kv_heads, splits if parallel else 1)](
        q,
        kv_cache,
        out,
        part,
        lse,
        query_start_loc,
        seq_lens,
        block_table,
        scale * _LOG2E,
        sinks_arg,
        num_tokens,
        num_reqs,
        *q.stride(),
        *out.stride(),
        *part_strides,
        *lse_strides,
        *kv_cache.stride(),
        *block_table.stride(),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_Q=launch.block_q,
        BLOCK_M=launch.block_m,
        TILE_N=launch.tile_n,
        SPLIT=SPLIT_KEYS,
        PARALLEL=parallel,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WINDOW=sliding_window or 0,
        SINKS=sink_logits is not None,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        enable_fp_fusion=False,
        **pdl.launch_kwargs(q),
    )
    if parallel:
        _invariant_combine_kernel[(num_tokens, num_kv_heads)](
            out,
            part,
            lse,
            query_start_loc,
            seq_lens,
            sinks_arg,
            num_reqs,
            *out.stride(),
            *part_strides,
            *lse_strides,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            GROUP=group,
            GROUP_PAD=max(2, triton.next_power_of_2(group)),
            SPLIT=SPLIT_KEYS,
            SINKS=sink_logits is not None,
            **pdl.launch_kwargs(q),
            num_warps=1 if group * head_dim_pad <= 1024 else 4,
            enable_fp_fusion=False,
        )
    return out


class TritonInvariantAttention:
    """:func:`invariant_paged_attention` as an
    :class:`~asyncstep.ops.base.AttentionOp`: q and k come unrotated and
    the KV store rotates them (a layer without a rotary: stored as they come)."""

    name = "triton-invariant"
    plans_decodes = False
    supports_sliding_window = True
    supports_sinks = True
    norms_qk = False
    rotates = True

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
        from asyncstep.ops.triton.attention import store_kv_cache
        from asyncstep.ops.triton.rotary import rotary_and_store_kv

        n, width = q.shape[0], shape.num_heads * shape.head_dim
        if cos_sin_cache is not None:
            assert meta.positions is not None, "a rotating KV store needs the positions"
            rotary_and_store_kv(
                meta.positions[:n],
                q,
                k,
                v,
                cos_sin_cache,
                shape.head_dim,
                kv_cache,
                meta.slot_mapping,
            )
        else:
            k3 = k.view(n, shape.num_kv_heads, shape.head_dim)
            store_kv_cache(
                k3, v.view(n, shape.num_kv_heads, shape.head_dim), kv_cache, meta.slot_mapping
            )
        out = invariant_paged_attention(
            q.view(n, shape.num_heads, shape.head_dim),
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            shape.scale,
            sliding_window=shape.sliding_window,
            sinks=shape.sinks,
        )
        return out.view(n, width)
