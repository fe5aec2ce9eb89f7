"""The model section: :class:`ModelConfig` (what to load, how, in which
dtype) and its choices. Imports msgspec and :mod:`asyncstep.errors` only.
"""

from __future__ import annotations

import os
from typing import Annotated

import msgspec

from asyncstep.config.utils import field_doc
from asyncstep.errors import ConfigError

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_PACKINGS = ("auto", "none", "q4")


class ModelConfig(msgspec.Struct, kw_only=True):
    """Which weights to run, and where.

    ``model`` is a GGUF file, an HF checkpoint directory, or None for the
    embedded default (SmolLM2-135M-Instruct). With ``load_format="dummy"``,
    ``model`` names a shape (see ``asyncstep.models.loader.dummy``) or an HF
    directory whose config is used with random weights. A ``pathlib.Path`` is
    accepted and stored as ``str``.

    ``max_model_len`` is the one context length of the engine: the user's
    limit (None: the model's own), which the engine replaces with the length
    it resolved when it starts, so that the config it hands on carries it.
    """

    model: Annotated[
        str | None,
        field_doc(
            "GGUF file or HF checkpoint directory (a shape name with load_format dummy); "
            "none: the embedded SmolLM2-135M-Instruct"
        ),
    ] = None
    load_format: Annotated[
        str, field_doc("weights format; dummy: random weights", choices=LOAD_FORMATS)
    ] = "auto"
    dtype: Annotated[
        str,
        field_doc(
            "weights and activations dtype; auto: bfloat16 on CUDA; on the CPU float32 where "
            "the decoder's weights stay in the CPU library's 4-bit blocks (a Q4_0/Q4_1 GGUF, "
            "or weight_packing q4), else bfloat16 on CPUs that multiply it natively "
            "(AVX512-BF16 or AMX) and float32 on others",
            choices=DTYPES,
        ),
    ] = "auto"
    weight_packing: Annotated[
        str,
        field_doc(
            "CPU, bfloat16 models (and float32 ones at dtype auto where the CPU library's "
            "quantized matmuls run: AVX512-VNNI or AVX2): also keep 4-bit weights (a GGUF's "
            "Q4_0/Q4_1) and an 8-bit LM head (Q8_0) packed (in their blocks for the CPU "
            "library where it runs, else as torch's int4/int8) for steps of at most "
            "packed_max_tokens tokens; "
            "CUDA: also keep 4-bit weights packed as Q4 and an 8-bit LM head (Q8_0) as Q8, "
            "for steps of one token; "
            "q4: first round the decoder's linear weights to 4 bits (Q4_1's grid) and, on CUDA, "
            "the LM head to 8 bits (Q8_0's grid), then as auto; "
            "none: dense weights only",
            choices=WEIGHT_PACKINGS,
        ),
    ] = "auto"
    packed_max_tokens: Annotated[
        int | None,
        field_doc(
            "CPU: steps of at most this many tokens use the packed weights (larger ones the "
            "dense weights: a request's greedy tokens may then depend on its batch); none: "
            "every step where the CPU library's quantized matmuls run (AVX512-VNNI or AVX2), "
            "else 8 (torch's int4/int8)"
        ),
    ] = None
    packed_weight_cache: Annotated[
        bool,
        field_doc(
            "CPU: keep the packed model of a checkpoint on disk (under $ASYNCSTEP_CACHE_DIR, "
            "default ~/.cache/asyncstep/weights; ~200 MiB for the embedded model; delete it to "
            "clear it) and map it at the next start instead of dequantizing and packing again"
        ),
    ] = True
    chat_template: Annotated[
        str | None,
        field_doc(
            "a Jinja chat template file to use instead of the tokenizer's (which may have "
            "none, or one without tools); checked at start-up by rendering a short chat"
        ),
    ] = None
    device: Annotated[str, field_doc("auto, cpu, cuda or cuda:N; auto: cuda when available")] = (
        "auto"
    )
    max_model_len: Annotated[
        int | None, field_doc("longest sequence (prompt + output); none: the model's own limit")
    ] = None
    seed: Annotated[
        int, field_doc("seed of random (dummy) weights and of every rank's torch RNG")
    ] = 0
    batch_invariant: Annotated[
        bool | None,
        field_doc(
            "a request's greedy tokens and log-probs the same bits whatever else is in its "
            "steps (batch, chunks, cache, speculation): on CUDA the Triton batch-invariant "
            "kernels (needs triton and the triton attention backend; fused_kernels and "
            "fused_decode then do not apply, packed weights are unused); on the CPU its "
            "packed weights already are, and dense bfloat16 ones run the CPU library's "
            "invariant matmul (false: torch's); none: the device's default (the CPU on, dense "
            "bfloat16 where the library's build is a SIMD one, AVX2 and up; CUDA on for a "
            "model of dense 16-bit weights without experts, with the triton attention "
            "backend and fused kernels, else off)"
        ),
    ] = None

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weight_packing not in WEIGHT_PACKINGS:
            raise ConfigError(
                f"weight_packing must be one of {WEIGHT_PACKINGS}, got {self.weight_packing!r}"
            )
        if self.packed_max_tokens is not None and self.packed_max_tokens < 0:
            raise ConfigError(f"packed_max_tokens must be >= 0, got {self.packed_max_tokens}")
        if self.batch_invariant and self.packed_max_tokens:
            # Packed weights up to N tokens, dense ones above: two roundings for one request.
            raise ConfigError(
                "batch_invariant needs one kernel for every step's size: leave "
                f"packed_max_tokens unset (got {self.packed_max_tokens})"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
