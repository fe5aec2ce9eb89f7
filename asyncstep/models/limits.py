"""Bounds on what a model file may declare, and strict type checks of its values.

A checkpoint is untrusted input: its config or metadata can declare any size,
and sizes turn into allocations. Every size a model declares is checked here,
in Python integers, before anything is built from it: each must be a non-bool
``int`` within a bound several times the largest real model's (a config past a
bound is no model asyncstep can run, whatever the machine), and each float
must be finite. The bounds also keep the arithmetic of the memory estimate
(:mod:`asyncstep.models.memory`) and of the file checks small and exact.
Imports only ``asyncstep.errors``.
"""

from __future__ import annotations

import math
from typing import Any

from asyncstep.errors import ModelLoadError

#: Largest real vocabularies are ~262k (Gemma 3).
MAX_VOCAB_SIZE = 1 << 20
#: Llama 3.1 405B: 16384.
MAX_HIDDEN_SIZE = 1 << 16
#: Llama 3.1 405B: 53248.
MAX_INTERMEDIATE_SIZE = 1 << 18
#: Llama 3.1 405B: 126.
MAX_NUM_LAYERS = 1 << 10
MAX_NUM_HEADS = 1 << 10
#: Real models use 64 to 256.
MAX_HEAD_DIM = 1 << 10
#: Longest real contexts are ~10M tokens (Llama 4 Scout).
MAX_CONTEXT_LENGTH = 1 << 24
#: A rope scaling factor (real ones: 2 to 64).
MAX_ROPE_FACTOR = 1 << 16
#: Experts of one MoE layer (real ones: 8 to 384).
MAX_NUM_EXPERTS = 1 << 10
#: MoE layers x experts of one model (each expert is 3 checkpoint tensors;
#: Qwen3-235B-A22B: 94 x 128).
MAX_EXPERT_LAYERS = 1 << 16

#: Metadata and tensor-table sizes of one GGUF file (real files: < 100 keys,
#: < 2,000 tensors, arrays of at most a few vocabularies' length in all).
MAX_GGUF_KEYS = 1 << 14
MAX_GGUF_TENSORS = 1 << 15
MAX_GGUF_ARRAY_LENGTH = 1 << 21
MAX_GGUF_ARRAY_ELEMENTS = 1 << 23
#: GGML tensors have at most 4 dimensions.
MAX_TENSOR_DIMS = 4

#: JSON files of a checkpoint directory, read whole (real: kilobytes; a big
#: model's index.json: ~10 MB), and the header of one safetensors file.
MAX_JSON_BYTES = 64 << 20
MAX_SAFETENSORS_HEADER_BYTES = 16 << 20
#: One file of an HF tokenizer (real tokenizer.json files: up to ~35 MB).
MAX_TOKENIZER_FILE_BYTES = 128 << 20


def is_int(value: object) -> bool:
    """A real integer: ``int`` but not ``bool`` (JSON ``true`` is no size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite ``int`` or ``float``, not ``bool``."""
    if is_int(value):
        return True
    return isinstance(value, float) and math.isfinite(value)


def bounded_int(what: str, value: Any, high: int, *, low: int = 1) -> int:
    """``value`` if it is an int in ``[low, high]``, else a one-line ModelLoadError."""
    if not is_int(value):
        raise ModelLoadError(f"{what} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise ModelLoadError(f"{what} must be in [{low}, {high}], got {_shown(value)}")
    return int(value)


def bounded_float(what: str, value: Any, high: float, *, low: float = 0.0) -> float:
    """``value`` as a float if it is a finite number in ``(low, high]``."""
    if not is_number(value):
        raise ModelLoadError(f"{what} must be a finite number, got {_shown(value)}")
    number = float(value)
    if not low < number <= high:
        raise ModelLoadError(f"{what} must be in ({low:g}, {high:g}], got {_shown(value)}")
    return number


def _shown(value: Any) -> str:
    """A value for a one-line message, however large."""
    if is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
