"""The attention kind of each layer (HF ``layer_types``): full, or sliding
over the config's window; and the check of a config's list.

Names are transformers' (:data:`FULL_ATTENTION`, :data:`SLIDING_ATTENTION`);
:func:`validate_layer_types` accepts an empty tuple (every layer's kind then
follows ``sliding_window``) or one known name per layer. Imports only
``asyncstep.errors``.
"""

from __future__ import annotations

from typing import Any

from asyncstep.errors import ModelLoadError, UnsupportedModelError

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
#: The ``layer_types`` names asyncstep runs.
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def validate_layer_types(layer_types: Any, num_layers: int) -> None:
    """``layer_types`` must be empty or a tuple of one known name per layer."""
    if not isinstance(layer_types, tuple):
        raise ModelLoadError("config: layer_types must be a list of names")
    if layer_types and len(layer_types) != num_layers:
        raise ModelLoadError(
            f"config: layer_types names {len(layer_types)} layers; the model has {num_layers}"
        )
    for name in layer_types:
        if name not in LAYER_TYPES:
            shown = repr(name)[:40] if isinstance(name, str) else type(name).__name__
            raise UnsupportedModelError(
                f"config: unsupported layer type {shown} ({', '.join(LAYER_TYPES)})"
            )
