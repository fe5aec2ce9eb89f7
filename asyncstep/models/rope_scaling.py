"""Rope scaling (HF ``rope_scaling`` / ``rope_parameters`` beyond the theta):
the types asyncstep runs and the check of a config's scaling.

:func:`validate_rope_scaling` is the gate: None, or an object of a known type
(:data:`ROPE_TYPES`) with the fields its type needs, every numeric field
finite and bounded (:mod:`asyncstep.models.limits`); YaRN's optional fields
typed, no partial rotary. Imports only ``asyncstep.errors`` and
:mod:`asyncstep.models.limits`.
"""

from __future__ import annotations

from typing import Any

from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.limits import MAX_CONTEXT_LENGTH, MAX_ROPE_FACTOR, bounded_float, bounded_int

#: The rope scaling types asyncstep runs (transformers' names).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: The rope scaling fields each type needs.
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
#: YaRN's optional float fields (transformers' ``_compute_yarn_parameters``).
_YARN_FLOATS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")


def validate_rope_scaling(scaling: Any) -> None:
    """``rope_scaling`` (HF spelling, ``rope_theta`` taken out) must be None or an
    object of a known type whose numeric fields are finite and bounded."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        kind = type(scaling).__name__
        raise ModelLoadError(f"config: rope_scaling must be an object, got {kind}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ModelLoadError("config: rope_scaling.rope_type must be a string")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key in scaling:
            bounded_float(f"config: rope_scaling.{key}", scaling[key], MAX_ROPE_FACTOR)
    key = "original_max_position_embeddings"
    if key in scaling:
        bounded_int(f"config: rope_scaling.{key}", scaling[key], MAX_CONTEXT_LENGTH)
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rope_type!r} ({', '.join(ROPE_TYPES)})"
        )
    for key in _ROPE_REQUIRED[rope_type]:
        if key not in scaling:
            raise ModelLoadError(f"config: rope_scaling of type {rope_type} lacks {key}")
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelLoadError("config: rope_scaling.high_freq_factor must exceed low_freq_factor")
    if rope_type == "yarn":
        _validate_yarn(scaling)


def _validate_yarn(scaling: dict[str, Any]) -> None:
    """YaRN's optional fields: floats (null: the default), ``truncate`` a bool,
    no partial rotary."""
    for key in _YARN_FLOATS:
        if scaling.get(key) is not None:
            bounded_float(f"config: rope_scaling.{key}", scaling[key], MAX_ROPE_FACTOR)
    if not isinstance(scaling.get("truncate", True), bool):
        raise ModelLoadError("config: rope_scaling.truncate must be true or false")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("unsupported rope scaling: partial_rotary_factor (only 1.0)")
