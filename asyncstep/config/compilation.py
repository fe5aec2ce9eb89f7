"""The compilation section: :class:`CompilationConfig` (CUDA graphs, the
attention backend, the kernels' choices). Imports msgspec and
:mod:`asyncstep.errors` only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncstep.config.utils import field_doc
from asyncstep.errors import ConfigError

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
#: How the GPU's Q4 / Q8 GEMVs take a 16-bit x (``gpu_q4_activations``).
GPU_Q4_ACTIVATIONS = ("float", "int8")


class CompilationConfig(msgspec.Struct, kw_only=True):
    """How a step's forward runs on the device (vLLM's ``CompilationConfig``).

    ``cudagraph_mode``: NONE (eager), PIECEWISE (every batch in graphs cut at
    attention, which runs eagerly between them), FULL (whole forward in one
    graph, any batch shape), FULL_DECODE_ONLY (FULL for uniform decode
    batches, eager otherwise), FULL_AND_PIECEWISE (FULL for uniform decode,
    PIECEWISE for the rest; the default). CUDA graphs need a CUDA device and
    the Triton attention backend; elsewhere the mode falls back to NONE. Any
    case is accepted; it is stored upper-case.

    ``cudagraph_capture_sizes``: token counts captured (batches are padded up
    to the next one); None: ``[1, 2, 4] + 8, 16, ..., 256 + 272, 288, ...``
    up to ``min(2 * max_num_seqs, 512)``, then steps of 256 (chunked
    prefills, PIECEWISE) up to ``max_cudagraph_capture_size`` (None:
    ``max_num_batched_tokens``, at most 4096). ``attention_backend``: auto
    (triton on CUDA; on the CPU the compiled CPU kernel where it builds, else torch).
    ``ubatch_*``: micro-batching (two micro-batches whose TP communication
    overlaps each other's compute); off by default.
    """

    cudagraph_mode: Annotated[
        str, field_doc("CUDA graphs by batch shape (CUDA only)", choices=CUDAGRAPH_MODES)
    ] = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: Annotated[
        list[int] | None,
        field_doc("token counts captured in CUDA graphs; none: 1 2 4 8 16 ... up to the max size"),
    ] = None
    max_cudagraph_capture_size: Annotated[
        int | None,
        field_doc("largest CUDA graph capture size; none: max_num_batched_tokens, at most 4096"),
    ] = None
    attention_backend: Annotated[
        str,
        field_doc(
            "auto: triton on CUDA; on the CPU the CPU kernel (compiled on first use) where "
            "a C compiler builds it, else torch (the reference)",
            choices=ATTENTION_BACKENDS,
        ),
    ] = "auto"
    fused_kernels: Annotated[
        bool,
        field_doc(
            "fuse residual add + RMSNorm and silu * up (Triton kernels with the triton"
            " backend, with rotary too; the CPU library's kernels on the CPU)"
        ),
    ] = True
    fused_decode: Annotated[
        bool,
        field_doc(
            "with fused_kernels on CUDA: decode batches rotate and store the new keys (and"
            " apply per-head q/k norms) in the attention kernel, one-token steps of a model"
            " whose linear layers are packed 4-bit run each layer's rest as four GEMVs (norms,"
            " SiLU*mul, residual adds in them), and one-token steps of a 16-bit model multiply"
            " by its dense weights with a Triton GEMV"
        ),
    ] = True
    gpu_q4_activations: Annotated[
        str,
        field_doc(
            "CUDA, one-token steps on packed Q4 weights (and the Q8 LM head): float: the"
            " GEMV multiplies x's own 16-bit values by the codes in float32; int8: it first"
            " quantizes x per block of 32 to int8 and multiplies with dp4a (faster; the"
            " products move by ~0.5 %, so greedy tokens may differ from float's)",
            choices=GPU_Q4_ACTIVATIONS,
        ),
    ] = "float"
    greedy_in_graph: Annotated[
        bool,
        field_doc(
            "one-token decode CUDA graphs end with the argmax of their logits: a step whose"
            " requests are all greedy without log-probs, penalties, logit bias, grammar or"
            " drafts takes its tokens from there (the same tokens; no sampler kernels)"
        ),
    ] = True
    enable_ubatching: Annotated[
        bool,
        field_doc("split large steps into two micro-batches (TP communication overlaps compute)"),
    ] = False
    ubatch_decode_threshold: Annotated[
        int, field_doc("fewest tokens of a decode step split into micro-batches")
    ] = 32
    ubatch_prefill_threshold: Annotated[
        int, field_doc("fewest tokens of a step with prompts split into micro-batches")
    ] = 512
    cudagraph_stand_in: Annotated[
        bool,
        field_doc(
            "run the graph modes without CUDA, replaying a graph by calling the captured "
            "function again (tests the padding and cuts on the CPU)"
        ),
    ] = False
    launch_inline: Annotated[
        bool | None,
        field_doc(
            "run a rank's runner calls on its event loop's thread instead of a launch "
            "thread (none: inline on CUDA without pipeline parallelism, where the calls "
            "only enqueue device work; a thread on the CPU, where a call is the forward "
            "itself, and on pipeline stages)"
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.cudagraph_mode.upper() not in CUDAGRAPH_MODES:
            raise ConfigError(
                f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}"
            )
        self.cudagraph_mode = self.cudagraph_mode.upper()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.gpu_q4_activations not in GPU_Q4_ACTIVATIONS:
            raise ConfigError(
                f"gpu_q4_activations must be one of {GPU_Q4_ACTIVATIONS}, "
                f"got {self.gpu_q4_activations!r}"
            )
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(s <= 0 for s in sizes)):
            raise ConfigError(f"cudagraph_capture_sizes must be positive sizes, got {sizes}")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size <= 0:
            raise ConfigError(
                "max_cudagraph_capture_size must be positive, "
                f"got {self.max_cudagraph_capture_size}"
            )
        if self.ubatch_decode_threshold < 2 or self.ubatch_prefill_threshold < 2:
            raise ConfigError("ubatch thresholds must be at least 2 tokens")
