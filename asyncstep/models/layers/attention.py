"""The attention layer: one layer's heads, scale and paged KV cache, over
its model's op set (:meth:`~asyncstep.ops.base.OpSet.attention`: the KV
store, and the rotary where the op set's store rotates, then the paged
attention). The step's metadata and the cache's layout are
:mod:`asyncstep.ops.attention`'s, the reference attention
:mod:`asyncstep.ops.torch_attention`'s (re-exported here for their older
importers).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncstep.models.layers.rotary import RotaryEmbedding
from asyncstep.ops.attention import (
    BLOCK_DIM,
    AttentionMetadata,
    AttentionShape,
    DecodeBucket,
    kv_cache_shape,
    plan_decode_buckets,
)
from asyncstep.ops.slot import OpSetSlot
from asyncstep.ops.torch_attention import (
    reference_attention,
    reference_attention_backends,
    write_kv_cache,
)

__all__ = [
    "BLOCK_DIM",
    "Attention",
    "AttentionMetadata",
    "DecodeBucket",
    "kv_cache_shape",
    "plan_decode_buckets",
    "reference_attention",
    "reference_attention_backends",
    "write_kv_cache",
]


class Attention(nn.Module):
    """Writes this layer's keys/values into its paged cache, then attends.

    The runner binds ``kv_cache`` once the cache is allocated. Rows past
    ``meta.num_actual_tokens`` are padding (sequence parallelism pads a step to
    a multiple of tp_size): they are neither written nor attended, and their
    output rows are zeros. q and k come rotated unless the op set's KV
    store rotates them (:attr:`~asyncstep.ops.base.OpSet.rotates_in_kv_store`,
    with ``rotary``'s cache; a layer without ``rotary`` is never rotated).
    ``sliding_window``: the layer's window in tokens (None: full attention;
    see :class:`~asyncstep.ops.attention.AttentionShape`). ``kv_cache_group``:
    the KV cache group the runner binds the layer to (its block table and
    slots are ``meta.kv_groups[kv_cache_group - 1]``'s; group 0: ``meta``'s own).
    ``layer_idx``: the model layer it belongs to.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        rotary: RotaryEmbedding | None = None,
        ops: OpSetSlot | None = None,
        sliding_window: int | None = None,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.shape = AttentionShape(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self.layer_idx = layer_idx
        self.kv_cache_group = 0
        self.kv_cache = torch.empty(0)
        self.rotary = [] if rotary is None else [rotary]  # shared, not a submodule
        self.ops = ops or (rotary.ops if rotary is not None else OpSetSlot())

    @property
    def norms_qk(self) -> bool:
        """Whether q and k come to :meth:`forward` un-normed (the op set's
        attention applies the shape's ``qk_norm``, where the layer has one)."""
        return self.shape.qk_norm is not None and self.ops.ops.attention_op.norms_qk

    @property
    def rotates(self) -> bool:
        """Whether q and k come to :meth:`forward` unrotated (its op set's
        KV store rotates them)."""
        return bool(self.rotary) and self.ops.ops.rotates_in_kv_store

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        cos_sin_cache = self.rotary[0].cos_sin_cache if self.rotary else None
        if self.kv_cache_group:
            meta = meta.kv_groups[self.kv_cache_group - 1]
        return self.ops.ops.attention(q, k, v, self.kv_cache, meta, self.shape, cos_sin_cache)
