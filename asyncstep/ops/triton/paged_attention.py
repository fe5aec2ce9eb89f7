"""The Triton attention op: the KV store then the paged attention kernels
(:mod:`asyncstep.ops.triton.attention`), reading only device metadata, so it
runs inside a CUDA graph (FULL ones too). Every row goes through, padding
too: a pad stores nothing (slot -1) and attends to nothing (past
``query_start_loc[-1]``: zeros).

``rotates``: q and k come unrotated, and the KV store rotates them in
place as it stores the keys (:func:`~asyncstep.ops.triton.rotary.rotary_and_store_kv`);
with ``fused_decode`` a uniform decode batch rotates and stores inside the
split-KV attention kernel (one kernel fewer). Not ``rotates``: q and k
come rotated and the store only stores. A layer with a sliding window runs
every batch through the query-tiled kernel with its window. A layer's
attention sinks (gpt-oss) go to whichever kernel runs. With ``fused_decode``
the op also applies a layer's per-head q/k norms (``norms_qk``): inside the
split-KV kernel for a uniform decode batch, else one kernel before the store.

May import torch, triton (on use) and :mod:`asyncstep.ops`' attention
metadata and Triton kernels.
"""

from __future__ import annotations

import torch

from asyncstep.ops.attention import AttentionMetadata, AttentionShape

__all__ = ["TritonAttention"]


class TritonAttention:
    """The Triton kernels as an :class:`~asyncstep.ops.base.AttentionOp`."""

    name = "triton"
    plans_decodes = False
    #: A windowed layer's batches all run the query-tiled kernel (not the
    #: split-KV decode kernels, nor the fused decode's store-and-attend).
    supports_sliding_window = True
    supports_sinks = True

    def __init__(self, *, rotates: bool, fused_decode: bool = False) -> None:
        self.rotates = rotates
        self.fused_decode = rotates and fused_decode
        self.norms_qk = self.fused_decode

    @classmethod
    def chosen(cls, *, fused_kernels: bool, fused_decode: bool) -> TritonAttention:
        """With the fused kernels the KV store rotates (and with
        ``fused_decode`` the decode attention stores)."""
        return cls(rotates=fused_kernels, fused_decode=fused_decode)

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
        from asyncstep.ops.triton.attention import (
            normed_qk,
            paged_attention,
            rotary_store_and_attend,
            store_kv_cache,
        )
        from asyncstep.ops.triton.rotary import rotary_and_store_kv

        n, width = q.shape[0], shape.num_heads * shape.head_dim
        qk_norm = shape.qk_norm if self.norms_qk else None
        if self.rotates and cos_sin_cache is not None:
            assert meta.positions is not None, "a rotating KV store needs the positions"
            if self.fused_decode and shape.sliding_window is None:
                out = rotary_store_and_attend(
                    meta.positions[:n],
                    q,
                    k,
                    v,
                    cos_sin_cache,
                    kv_cache,
                    meta.slot_mapping,
                    meta.query_start_loc,
                    meta.seq_lens,
                    meta.block_table,
                    shape.scale,
                    uniform_decode=meta.max_query_len == 1,
                    max_query_len=meta.max_query_len,
                    sinks=shape.sinks,
                    qk_norm=qk_norm,
                )
                return out.view(n, width)
            q, k = normed_qk(q, k, qk_norm)
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
            q, k = normed_qk(q, k, qk_norm)
            k = k.view(n, shape.num_kv_heads, shape.head_dim)
            v = v.view(n, shape.num_kv_heads, shape.head_dim)
            store_kv_cache(k, v, kv_cache, meta.slot_mapping)
        out = paged_attention(
            q.view(n, shape.num_heads, shape.head_dim),
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            shape.scale,
            max_query_len=meta.max_query_len,
            sliding_window=shape.sliding_window,
            sinks=shape.sinks,
        )
        return out.view(n, width)
