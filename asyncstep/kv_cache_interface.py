"""The KV cache groups of a model: its attention layers grouped by attention
type (full, or a sliding window of ``W`` tokens), as vLLM v1's hybrid KV
cache manager groups them. Pure Python: the scheduler's KV cache manager and
the runner both read it.

Contract:

* Layers of one type form ``count / size`` groups of ``size`` layers each,
  ``size`` the greatest common divisor of the types' layer counts (so every
  group has the same number of layers); a model whose layers are all of one
  type has one group of all its layers (full attention: exactly the
  single-table cache).
* Block ids come from one pool. Block ``b`` of group ``g`` lives at block
  ``b`` of the KV cache tensors of that group's layers, and the ``j``-th
  layer of every group shares one tensor (``size`` tensors in all): a block
  is ``size`` layers' worth of KV for ``block_size`` tokens, whichever group
  holds it.
* A request's block ids as the scheduler sends them (new, resumed, appended)
  are the groups' ids interleaved: entry ``i * num_groups + g`` is group
  ``g``'s block for the request's tokens ``[i * block_size, (i + 1) *
  block_size)``. With one group this is the plain list.
* A windowed group's blocks that fall wholly before its window (the query at
  position ``p`` sees keys ``p - W + 1 .. p``) are freed by the KV cache
  manager; the request's table then names :data:`NULL_BLOCK_ID` there (or
  the stale id the runner already had), whose contents no attention op uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NULL_BLOCK_ID", "KVCacheGroupSpec", "kv_cache_groups"]

#: The block a windowed group's table names for the blocks it freed (or
#: never held: before a prefix-cache hit's window). Reserved, never
#: allocated, only in a pool with a windowed group.
NULL_BLOCK_ID = 0


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One KV cache group: its layers (model layer indices, ascending) and
    their sliding window (None: full attention)."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None


def kv_cache_groups(layer_windows: tuple[int | None, ...]) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model whose layer ``i`` has window ``layer_windows[i]``
    (see the module's contract); full-attention groups first, then by window."""
    if not layer_windows:
        return ()
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_type.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_type.values()))
    groups = []
    for window in sorted(by_type, key=lambda w: -1 if w is None else w):
        layers = by_type[window]
        for start in range(0, len(layers), size):
            groups.append(KVCacheGroupSpec(tuple(layers[start : start + size]), window))
    return tuple(groups)
