"""Which paged KV cache tensor each attention layer of a model uses, and
their allocation and binding (vLLM's ``bind_kv_cache``):
:class:`KVCacheBinding` reads the model's KV cache groups
(:mod:`asyncstep.kv_cache_interface`), tells each attention layer its group,
and binds one tensor per layer (with several groups, one per layer position
within a group, shared by the groups' layers at that position). A draft
model's layers are bound the same way, to tensors of their own
(:func:`check_draft_windows` says which draft models may share the target's
block table).

May import torch, ``asyncstep.errors``, ``asyncstep.kv_cache_interface``,
``asyncstep.ops.attention``, the model (no layer class) and
:mod:`asyncstep.runner.kv_sizing`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from asyncstep.errors import ConfigError
from asyncstep.kv_cache_interface import kv_cache_groups
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.ops.attention import kv_cache_shape
from asyncstep.runner.kv_sizing import zeroed_host_tensors

__all__ = ["KVCacheBinding", "check_draft_windows"]


class _KVLayer(Protocol):
    """An attention layer as the KV cache binding reads it (the runner sets
    its ``kv_cache``; it imports no layer class)."""

    @property
    def layer_idx(self) -> int: ...


class KVCacheBinding:
    """``model``'s KV cache groups and its layers' tensors: each attention
    layer of this stage is told its group (0 with one group) at once."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        #: The model's KV cache groups (:mod:`asyncstep.kv_cache_interface`).
        self.groups = kv_cache_groups(model.config.layer_windows)
        self.num_groups = max(len(self.groups), 1)
        #: Model layer -> its position within its KV cache group (its tensor).
        self._position: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            for position, layer in enumerate(group.layer_ids):
                self._position[layer] = position
                group_of[layer] = g
        for attn in model.attention_layers():  # this stage's
            attn.kv_cache_group = group_of[attn.layer_idx] if self.num_groups > 1 else 0

    def tensor_index(self, attn: _KVLayer) -> int:
        """The KV cache tensor ``attn`` uses (its own layer's, with one group)."""
        if len(self.groups) <= 1:
            return id(attn)
        return self._position[attn.layer_idx]

    def block_bytes(self, model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one KV block takes over ``model``'s KV cache tensors (all its
        layers; with several groups, one group's layers: a block belongs to
        one group)."""
        layers = model.attention_layers()
        per_layer = sum(2 * a.num_kv_heads * a.head_dim for a in layers[:1])
        num_tensors = len({self.tensor_index(a) for a in layers})
        return per_layer * num_tensors * block_size * dtype.itemsize

    def bind(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        *,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        """``model``'s KV cache tensors of ``num_blocks`` blocks, zeroed, each
        bound to its layers (in layer order)."""
        layers = model.attention_layers()
        index = [self.tensor_index(attn) for attn in layers]
        first = {i: attn for i, attn in reversed(list(zip(index, layers, strict=True)))}
        order = list(dict.fromkeys(index))  # in layer order
        shapes = [
            kv_cache_shape(num_blocks, block_size, first[i].num_kv_heads, first[i].head_dim)
            for i in order
        ]
        if device.type == "cpu":
            caches = zeroed_host_tensors(shapes, dtype)
        else:
            caches = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        by_index = dict(zip(order, caches, strict=True))
        for attn, i in zip(layers, index, strict=True):
            attn.kv_cache = by_index[i]
        return caches


def check_draft_windows(
    model: LlamaForCausalLM, draft_model: LlamaForCausalLM, num_kv_cache_groups: int
) -> None:
    """A draft model shares the target's block table: it may read only what
    the target's KV cache manager keeps (no block freed before its windows)."""
    windows = [w for w in model.config.layer_windows if w is not None]
    if not windows:
        return
    if num_kv_cache_groups > 1:
        raise ConfigError(
            "speculative decoding with a draft model does not support models that mix "
            "sliding-window and full attention layers yet"
        )
    if any(w is None or w > min(windows) for w in draft_model.config.layer_windows):
        raise ConfigError(
            f"the target's KV cache keeps only its sliding window ({min(windows)} tokens): "
            "a draft model must attend within it"
        )
