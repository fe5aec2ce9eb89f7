"""Engine configuration: model, cache, scheduler, parallel, compilation and
structured-output settings.

Every section is a keyword-only :class:`msgspec.Struct`: the whole
:class:`EngineConfig` is msgpack-encodable and travels as it is to the engine
core and to every rank. Each section validates itself in ``__post_init__``
(run on construction and on decode alike) with one-line
:class:`~asyncstep.errors.ConfigError` messages. Each user-facing field carries
its one-line description (``msgspec.Meta(description=...)``, choices in
``extra``): :func:`engine_options` reads them, and so ``make_config``'s
keywords and the CLI's flags are derived from the fields, written once.
Imports nothing heavy.
"""

from __future__ import annotations

import difflib
import functools
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any, get_args, get_origin

import msgspec

from asyncstep.cpu_features import cpu_has_bf16
from asyncstep.errors import ConfigError

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_PACKINGS = ("auto", "none", "q4")
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
#: How the GPU's Q4 / Q8 GEMVs take a 16-bit x (``gpu_q4_activations``).
GPU_Q4_ACTIVATIONS = ("float", "int8")
#: How the front end picks a data-parallel replica per request
#: (:mod:`asyncstep.engine.front_end.dp_router`).
DATA_PARALLEL_ROUTINGS = ("prefix", "load", "round-robin")
#: Most data-parallel replicas of one front end.
MAX_DATA_PARALLEL_SIZE = 64
#: A step's token budget (``max_num_batched_tokens``) when none is given, on CUDA.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: ... and on the CPU, where a step's time grows with its tokens (about a
#: millisecond each where the CPU multiplies bfloat16, 4 to 5 in float32 on
#: AVX2): small enough that a step of the embedded model stays under a
#: second, so no stream's next token (nor an abort, which waits for the step
#: in flight) waits long behind a long prompt's prefill (chunked over
#: steps). The study that picked it: ``benchmarks/studies/cpu_step_budget/README.md``
#: (its question, command, figures and decision); run it again when the CPU
#: forward changes. Where the CPU multiplies bfloat16 (AVX512-BF16, AMX):
CPU_MAX_NUM_BATCHED_TOKENS = 256
#: ... elsewhere (the model runs float32).
CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS = 128


def cpu_max_num_batched_tokens() -> int:
    """The CPU's step budget when none is given: by whether it multiplies bfloat16."""
    return CPU_MAX_NUM_BATCHED_TOKENS if cpu_has_bf16() else CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS


def _doc(description: str, **extra: object) -> msgspec.Meta:
    """A field's one-line description (the CLI help); ``extra``: e.g. ``choices``."""
    return msgspec.Meta(description=description, extra=extra or None)


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
        _doc(
            "GGUF file or HF checkpoint directory (a shape name with load_format dummy); "
            "none: the embedded SmolLM2-135M-Instruct"
        ),
    ] = None
    load_format: Annotated[
        str, _doc("weights format; dummy: random weights", choices=LOAD_FORMATS)
    ] = "auto"
    dtype: Annotated[
        str,
        _doc(
            "weights and activations dtype; auto: bfloat16 on CUDA; on the CPU float32 where "
            "the decoder's weights stay in the CPU library's 4-bit blocks (a Q4_0/Q4_1 GGUF, "
            "or weight_packing q4), else bfloat16 on CPUs that multiply it natively "
            "(AVX512-BF16 or AMX) and float32 on others",
            choices=DTYPES,
        ),
    ] = "auto"
    weight_packing: Annotated[
        str,
        _doc(
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
        _doc(
            "CPU: steps of at most this many tokens use the packed weights (larger ones the "
            "dense weights: a request's greedy tokens may then depend on its batch); none: "
            "every step where the CPU library's quantized matmuls run (AVX512-VNNI or AVX2), "
            "else 8 (torch's int4/int8)"
        ),
    ] = None
    packed_weight_cache: Annotated[
        bool,
        _doc(
            "CPU: keep the packed model of a checkpoint on disk (under $ASYNCSTEP_CACHE_DIR, "
            "default ~/.cache/asyncstep/weights; ~200 MiB for the embedded model; delete it to "
            "clear it) and map it at the next start instead of dequantizing and packing again"
        ),
    ] = True
    chat_template: Annotated[
        str | None,
        _doc(
            "a Jinja chat template file to use instead of the tokenizer's (which may have "
            "none, or one without tools); checked at start-up by rendering a short chat"
        ),
    ] = None
    device: Annotated[str, _doc("auto, cpu, cuda or cuda:N; auto: cuda when available")] = "auto"
    max_model_len: Annotated[
        int | None, _doc("longest sequence (prompt + output); none: the model's own limit")
    ] = None
    seed: Annotated[int, _doc("seed of random (dummy) weights and of every rank's torch RNG")] = 0
    batch_invariant: Annotated[
        bool | None,
        _doc(
            "a request's greedy tokens and log-probs the same bits whatever else is in its "
            "steps (batch, chunks, cache, speculation): on CUDA the Triton batch-invariant "
            "kernels (needs triton and the triton attention backend; fused_kernels and "
            "fused_decode then do not apply, packed weights are unused); on the CPU its "
            "packed weights already are, and dense bfloat16 ones run the CPU library's "
            "invariant matmul (false: torch's); none: the device's default (the CPU on, dense "
            "bfloat16 where the library's build is a SIMD one, AVX2 and up; CUDA off)"
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


class CacheConfig(msgspec.Struct, kw_only=True):
    """The paged KV cache: block size and how many blocks."""

    block_size: Annotated[int, _doc("tokens per KV cache block (a power of two)")] = 16
    num_blocks: Annotated[
        int | None,
        _doc(
            "KV cache blocks; none: as many as kv_cache_memory_gib (CPU) or "
            "gpu_memory_utilization (CUDA) allows"
        ),
    ] = None
    kv_cache_memory_gib: Annotated[float, _doc("KV cache size on the CPU (GiB)")] = 1.0
    gpu_memory_utilization: Annotated[
        float, _doc("fraction of the GPU's memory the rank may fill (weights + KV cache)")
    ] = 0.85
    enable_prefix_caching: Annotated[
        bool, _doc("share the KV blocks of identical prompt prefixes between requests")
    ] = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(
                f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """Continuous batching limits.

    ``max_num_seqs``: with pipeline parallelism each of the ``pp_size`` steps
    in flight holds different requests, so up to ``pp_size * max_num_seqs``
    run at once (vLLM v0's virtual engines).

    ``max_concurrent_batches``: the engine's batch queue; 0 chooses (see
    :attr:`EngineConfig.batch_queue_size`). With overlap, 3 also hides the
    engine's update and schedule of a step behind the device (a stop is then
    found two steps late: the extra tokens are dropped). On the CPU with one
    pipeline stage, 0 is one step at a time: a step queued behind the one
    computing is a whole forward there, and an abort (taken between steps)
    would wait for it too; what overlap would hide, the engine's update and
    schedule of a step, is small beside a CPU forward.

    ``gil_switch_interval_s``: the launch thread and the event loop share the
    GIL; a short interval keeps their hand-offs from stalling the device.

    ``max_num_batched_tokens`` None is resolved for the device when the
    engine starts (:meth:`EngineConfig.resolve_for_device`): the config it
    hands on carries the number.
    """

    max_num_batched_tokens: Annotated[
        int | None,
        _doc(
            "token budget of one step (prompt chunks + decodes); none: "
            f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} on CUDA, {CPU_MAX_NUM_BATCHED_TOKENS} on a CPU "
            f"that multiplies bfloat16, else {CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS}"
        ),
    ] = None
    max_num_seqs: Annotated[int, _doc("most requests in one step")] = 64
    enable_chunked_prefill: Annotated[
        bool, _doc("split long prompts over several steps (chunked prefill)")
    ] = True
    async_scheduling: Annotated[
        bool,
        _doc(
            "overlap: launch step N+1 while step N is sampled and delivered "
            "(off: one step at a time, for ablation and debugging)"
        ),
    ] = True
    max_concurrent_batches: Annotated[
        int,
        _doc(
            "steps in flight; 0: 1 without overlap or on the CPU, 2 with overlap on CUDA, "
            "the pipeline depth with PP"
        ),
    ] = 0
    gil_switch_interval_s: Annotated[
        float | None,
        _doc("sys.setswitchinterval while a rank serves; none: Python's 5 ms"),
    ] = 0.0005

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_concurrent_batches < 0:
            raise ConfigError(
                "max_concurrent_batches must be 0 (automatic) or positive, "
                f"got {self.max_concurrent_batches}"
            )
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ConfigError(
                "gil_switch_interval_s must be positive (or None), "
                f"got {self.gil_switch_interval_s}"
            )


class ParallelConfig(msgspec.Struct, kw_only=True):
    """Tensor and pipeline parallel sizes (rank = pp_rank * tp_size + tp_rank).

    ``sequence_parallel`` keeps the residual stream split along tokens over
    the TP group (Megatron-SP): reduce-scatter + all-gather in place of each
    all-reduce; steps are padded to a multiple of tensor_parallel_size. No
    effect without tensor parallelism.

    With more than one rank, the engine listens on ``listen`` (``HOST:PORT``,
    loopback and any free port by default) for its ranks' control
    connections, and starts them itself as local processes unless
    ``launch_ranks`` is False (ranks started elsewhere, e.g. by torchrun,
    connect to that address).

    ``enable_expert_parallel`` (vLLM's name): a MoE model's experts are
    sharded whole over the TP group (expert parallelism, EP = TP): each rank
    holds ``num_experts / tensor_parallel_size`` experts and token rows are
    dispatched to them and combined back with all-to-all
    (:mod:`asyncstep.models.layers.moe`). A no-op with one TP rank; refused
    for a dense model or an expert count the TP size does not divide.

    ``data_parallel_size`` (vLLM's name): that many engine cores, each with
    its own ranks (TP x PP) and KV cache, behind one front end; each request
    goes to one replica, picked by ``data_parallel_routing``
    (:mod:`asyncstep.engine.front_end.dp_router`; ``prefix``: the replica
    holding the request's longest prompt prefix unless its load exceeds the
    least loaded replica's by more than ``data_parallel_balance_threshold``).
    ``data_parallel_rank`` set: this engine is that one replica (its CPU
    threads a ``1 / data_parallel_size`` share), for a router outside.

    ``pp_tensor_lanes``: between pipeline stages with TP, each TP rank sends
    ``1 / tp_size`` of every replicated tensor to its peer and the receiving
    stage all-gathers (vLLM's way; pays where the stage-to-stage link is slower
    than the links inside a stage, e.g. stages on different hosts). False: each
    TP rank sends its whole tensors, no gather (faster on one NVLink host:
    ``benchmarks/studies/layout/README.md``).
    """

    tensor_parallel_size: Annotated[int, _doc("tensor-parallel ranks per pipeline stage")] = 1
    pipeline_parallel_size: Annotated[int, _doc("pipeline stages")] = 1
    sequence_parallel: Annotated[
        bool, _doc("keep activations split along tokens over the TP group (Megatron-SP)")
    ] = False
    enable_expert_parallel: Annotated[
        bool,
        _doc(
            "MoE models: shard the experts whole over the TP ranks and dispatch tokens "
            "to them with all-to-all (expert parallelism; no-op with one TP rank)"
        ),
    ] = False
    launch_ranks: Annotated[
        bool,
        _doc(
            "start the ranks as local processes (off: wait for ranks started elsewhere, "
            "python -m asyncstep.rank, to connect)"
        ),
    ] = True
    listen: Annotated[
        str, _doc("address the ranks connect to (HOST:PORT; port 0: any free port)")
    ] = "127.0.0.1:0"
    rank_log_level: Annotated[str, _doc("console log level of the rank processes")] = "warning"
    rank_log_json: Annotated[
        str | None,
        _doc("started ranks write every event as JSON lines to <this>.rank<N>; none: not"),
    ] = None
    pp_tensor_lanes: Annotated[
        bool,
        _doc(
            "between stages, each TP rank sends 1/TP of a tensor and the next stage "
            "all-gathers (off: whole tensors, faster on one NVLink host)"
        ),
    ] = True
    engine_process: Annotated[
        bool,
        _doc(
            "run the scheduler and the rank in a child process (the engine core); "
            "off keeps them in the caller's process (debugging, tests)"
        ),
    ] = True
    cpu_threads: Annotated[
        int | None,
        _doc(
            "CPU: torch threads of each rank's forward; none: every core the process may "
            "use, divided among the ranks of this machine"
        ),
    ] = None
    data_parallel_size: Annotated[
        int, _doc("engine cores (replicas, each with its own ranks) behind the front end")
    ] = 1
    data_parallel_routing: Annotated[
        str,
        _doc(
            "how a request's replica is picked: by prompt prefix then load, by load alone "
            "(waiting*4 + running), or in turn",
            choices=DATA_PARALLEL_ROUTINGS,
        ),
    ] = "prefix"
    data_parallel_balance_threshold: Annotated[
        int,
        _doc(
            "prefix routing: the replica holding the longest prefix is skipped when its "
            "load exceeds the least loaded one's by more than this"
        ),
    ] = 32
    data_parallel_rank: Annotated[
        int | None,
        _doc(
            "this engine is that one replica of data_parallel_size (an outside router "
            "in front); none: all of them, behind this front end's router"
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if not 1 <= self.data_parallel_size <= MAX_DATA_PARALLEL_SIZE:
            raise ConfigError(
                f"data_parallel_size must be in [1, {MAX_DATA_PARALLEL_SIZE}], "
                f"got {self.data_parallel_size}"
            )
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTINGS:
            raise ConfigError(
                f"data_parallel_routing must be one of {DATA_PARALLEL_ROUTINGS}, "
                f"got {self.data_parallel_routing!r}"
            )
        rank = self.data_parallel_rank
        if rank is not None and not 0 <= rank < self.data_parallel_size:
            raise ConfigError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), got {rank}"
            )
        if self.data_parallel_balance_threshold < 0:
            raise ConfigError(
                "data_parallel_balance_threshold must be >= 0, "
                f"got {self.data_parallel_balance_threshold}"
            )
        replicas_here = self.data_parallel_size > 1 and rank is None
        if replicas_here and not self.engine_process:
            raise ConfigError(
                "data_parallel_size > 1 runs each replica's engine core in its own process "
                "(engine_process must be on)"
            )
        if replicas_here and not self.launch_ranks:
            raise ConfigError(
                "data_parallel_size > 1 starts each replica's ranks itself "
                "(launch_ranks must be on)"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1 (or none), got {self.cpu_threads}")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"listen must be HOST:PORT, got {self.listen!r}")
        if self.data_parallel_size > 1 and self.world_size > 1 and int(port) != 0:
            raise ConfigError(
                "data_parallel_size > 1: each replica's ranks connect to a port of its own "
                f"(listen's port must be 0, got {self.listen!r})"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def listen_address(self) -> tuple[str, int]:
        """``listen`` as (host, port)."""
        host, _, port = self.listen.rpartition(":")
        return host, int(port)


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
        str, _doc("CUDA graphs by batch shape (CUDA only)", choices=CUDAGRAPH_MODES)
    ] = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: Annotated[
        list[int] | None,
        _doc("token counts captured in CUDA graphs; none: 1 2 4 8 16 ... up to the max size"),
    ] = None
    max_cudagraph_capture_size: Annotated[
        int | None,
        _doc("largest CUDA graph capture size; none: max_num_batched_tokens, at most 4096"),
    ] = None
    attention_backend: Annotated[
        str,
        _doc(
            "auto: triton on CUDA; on the CPU the CPU kernel (compiled on first use) where "
            "a C compiler builds it, else torch (the reference)",
            choices=ATTENTION_BACKENDS,
        ),
    ] = "auto"
    fused_kernels: Annotated[
        bool,
        _doc(
            "fuse residual add + RMSNorm and silu * up (Triton kernels with the triton"
            " backend, with rotary too; the CPU library's kernels on the CPU)"
        ),
    ] = True
    fused_decode: Annotated[
        bool,
        _doc(
            "with fused_kernels on CUDA: decode batches rotate and store the new keys in the"
            " attention kernel, one-token steps of a model whose linear layers are packed"
            " 4-bit run each layer's rest as four GEMVs (norms, SiLU*mul, residual adds in"
            " them), and one-token steps of a 16-bit model multiply by its dense weights"
            " with a Triton GEMV"
        ),
    ] = True
    gpu_q4_activations: Annotated[
        str,
        _doc(
            "CUDA, one-token steps on packed Q4 weights (and the Q8 LM head): float: the"
            " GEMV multiplies x's own 16-bit values by the codes in float32; int8: it first"
            " quantizes x per block of 32 to int8 and multiplies with dp4a (faster; the"
            " products move by ~0.5 %, so greedy tokens may differ from float's)",
            choices=GPU_Q4_ACTIVATIONS,
        ),
    ] = "float"
    greedy_in_graph: Annotated[
        bool,
        _doc(
            "one-token decode CUDA graphs end with the argmax of their logits: a step whose"
            " requests are all greedy without log-probs, penalties, logit bias, grammar or"
            " drafts takes its tokens from there (the same tokens; no sampler kernels)"
        ),
    ] = True
    enable_ubatching: Annotated[
        bool,
        _doc("split large steps into two micro-batches (TP communication overlaps compute)"),
    ] = False
    ubatch_decode_threshold: Annotated[
        int, _doc("fewest tokens of a decode step split into micro-batches")
    ] = 32
    ubatch_prefill_threshold: Annotated[
        int, _doc("fewest tokens of a step with prompts split into micro-batches")
    ] = 512
    cudagraph_stand_in: Annotated[
        bool,
        _doc(
            "run the graph modes without CUDA, replaying a graph by calling the captured "
            "function again (tests the padding and cuts on the CPU)"
        ),
    ] = False
    launch_inline: Annotated[
        bool | None,
        _doc(
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


#: ``reasoning_parser`` names (:class:`asyncstep.engine.chat.reasoning.ReasoningParser`).
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class StructuredOutputsConfig(msgspec.Struct, kw_only=True):
    """Grammars of structured outputs: the budget each is checked against at
    the door, before anything builds or compiles it, and the bounds of their
    compiles in the engine core.

    The budget (``grammar_max_*``) is a first, cheap filter (an over-budget
    grammar is refused with a one-line error naming the option): xgrammar's
    compile time grows faster than linearly with a grammar's literal bytes,
    alternatives, properties and nesting. It cannot see every costly grammar
    (a short bounded repetition can compile for seconds), so each compile
    runs first in a worker process that is killed past
    ``grammar_compile_timeout_s`` or ``grammar_compile_memory_mib``, and when
    every request waiting for it went away. The defaults pass real-world
    grammars (tool-call and form schemas of hundreds of properties, nesting
    to 32 levels) and refuse the sizes of the attacks in
    ``benchmarks/studies/grammar/README.md``.
    """

    grammar_max_bytes: Annotated[
        int,
        _doc(
            "most bytes of a regex or EBNF grammar, of a choice list, and of the literals "
            "of a JSON schema (property names, enum and const values, patterns)"
        ),
    ] = 64 << 10
    grammar_max_alternatives: Annotated[
        int,
        _doc(
            "most alternatives of a grammar: '|' in a regex or EBNF grammar (a JSON "
            "schema's patterns included), strings of a choice, enum values of a JSON schema"
        ),
    ] = 4096
    grammar_max_properties: Annotated[
        int,
        _doc(
            "most properties of a JSON schema, with its other subschemas "
            "(items, anyOf/oneOf/allOf branches, $defs, ...)"
        ),
    ] = 2048
    grammar_max_depth: Annotated[
        int,
        _doc(
            "deepest nesting of a grammar: subschemas of a JSON schema (its JSON at most "
            "4 times as deep), parentheses of a regex or EBNF grammar"
        ),
    ] = 32
    grammar_compile_workers: Annotated[
        int,
        _doc(
            "worker processes compiling grammars (started with the first structured "
            "request; each compile waits its turn, round robin over the clients)"
        ),
    ] = 1
    grammar_compile_idle_s: Annotated[
        float,
        _doc(
            "seconds a compile worker may wait for a compile: then it exits and frees its "
            "memory (xgrammar and the vocabulary); the next grammar not in the cache starts "
            "one again"
        ),
    ] = 60.0
    grammar_compile_timeout_s: Annotated[
        float,
        _doc(
            "most CPU seconds one grammar's compile may take (and 10 times that of waiting): "
            "past it the compile is killed, its requests refused"
        ),
    ] = 10.0
    grammar_compile_memory_mib: Annotated[
        int,
        _doc(
            "most memory (MiB) one grammar's compile may add to its worker: past it the "
            "compile is killed, its requests refused"
        ),
    ] = 256
    grammar_cache_mib: Annotated[
        int, _doc("compiled grammars kept for reuse (MiB, as xgrammar counts their memory)")
    ] = 64
    reasoning_parser: Annotated[
        str | None,
        _doc(
            "the model thinks first (<think>...</think>): a chat's thinking goes to "
            "reasoning_content, apart from its content, and a grammar (structured outputs, "
            "forced tool calls) applies from the end of the thinking on: qwen3 or deepseek_r1 "
            "(none: no thinking apart)"
        ),
    ] = None

    def __post_init__(self) -> None:
        for name in (
            "grammar_max_bytes",
            "grammar_max_alternatives",
            "grammar_max_properties",
            "grammar_max_depth",
            "grammar_compile_workers",
            "grammar_compile_memory_mib",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("grammar_compile_timeout_s", "grammar_compile_idle_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.grammar_cache_mib < 0:
            raise ConfigError(
                f"grammar_cache_mib must be 0 (no cache) or positive, got {self.grammar_cache_mib}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )


#: Speculative decoding methods (vLLM's names) that asyncstep implements.
SPECULATIVE_METHODS = ("ngram", "draft_model")
#: Most draft tokens per step: a verify step of ``1 + k`` tokens stays within the
#: CPU's packed one-call path (16 tokens) and the rejection sampler's small tensors.
MAX_SPECULATIVE_TOKENS = 15
#: ``prompt_lookup_min`` / ``prompt_lookup_max`` when neither is given (vLLM's).
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding, vLLM's ``speculative_config`` names.

    ``method`` ``"draft_model"``: a smaller checkpoint ``model`` of the same
    vocabulary proposes ``num_speculative_tokens`` tokens greedily after each
    step, on the same rank with a KV cache of its own (one tensor-parallel
    rank; see :mod:`asyncstep.runner.draft_model`); the lookup bounds are
    unused.

    ``method`` ``"ngram"``: prompt lookup (no draft model): the drafts are the
    up to ``num_speculative_tokens`` tokens that followed an earlier
    occurrence of the sequence's last ``n`` tokens, for the longest ``n`` in
    ``[prompt_lookup_min, prompt_lookup_max]`` that occurs (prompt and output
    both searched; see :mod:`asyncstep.engine.spec_decode.ngram_proposer`). One of the
    two lookup bounds given sets the other (vLLM's rule); neither: both
    :data:`DEFAULT_PROMPT_LOOKUP`. ``disable_by_batch_size`` (vLLM's name):
    no drafts in a step while at least this many requests run (a verify
    step grows with the batch; on the CPU past ``packed_max_tokens`` tokens
    it leaves the one-call decoder stack); None: never. A bad value is a
    one-line :class:`ConfigError`; the resolved bounds are stored.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    #: ``"draft_model"``: the draft checkpoint (a path; a shape name with
    #: dummy weights), with the target's tokenizer.
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError(
                'speculative_config needs "model" (the draft checkpoint) with method '
                '"draft_model", and only then'
            )
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "speculative_config num_speculative_tokens must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if high is None:
            high = DEFAULT_PROMPT_LOOKUP if low is None else low
        if low is None:
            low = high
        if not 1 <= low <= high:
            raise ConfigError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {low} and {high}"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = low, high
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(
                "speculative_config disable_by_batch_size must be >= 1 (or none), "
                f"got {self.disable_by_batch_size}"
            )


class SpeculativeSection(msgspec.Struct, kw_only=True):
    """The speculative decoding section: one option, vLLM's
    ``speculative_config`` (a :class:`SpeculativeConfig`, or a dict of its
    fields; on the command line, JSON). None: no speculation."""

    speculative_config: Annotated[
        SpeculativeConfig | None,
        _doc(
            'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": k, '
            '"prompt_lookup_min": m, "prompt_lookup_max": M} or {"method": "draft_model", '
            '"model": PATH, "num_speculative_tokens": k}; none: off'
        ),
    ] = None


class EngineConfig(msgspec.Struct, kw_only=True):
    """The whole engine configuration, one section per concern.

    Build it from flat options with :meth:`from_options` (``make_config``),
    or decode it with :func:`decode_config`; either way a bad value ends in
    one :class:`ConfigError`.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    compilation: CompilationConfig = msgspec.field(default_factory=CompilationConfig)
    structured_outputs: StructuredOutputsConfig = msgspec.field(
        default_factory=StructuredOutputsConfig
    )
    speculative: SpeculativeSection = msgspec.field(default_factory=SpeculativeSection)

    def __post_init__(self) -> None:
        if self.speculative_config is not None and self.parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "speculative_config does not work with pipeline parallelism yet "
                "(pipeline_parallel_size must be 1)"
            )
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.parallel.world_size > 1:
            raise ConfigError(
                'speculative_config method "draft_model" runs on one rank only '
                "(tensor_parallel_size must be 1)"
            )

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding settings (None: off)."""
        return self.speculative.speculative_config

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """The config of flat options (:func:`engine_options`' names; the
        rest default). Values are type-checked and validated as on decode (so
        the config encodes and decodes to itself); a path or a numpy scalar
        counts as its builtin value. An unknown name or a bad value raises a
        one-line :class:`ConfigError`."""
        known = engine_options()
        sections: dict[str, dict[str, object]] = {}
        for name, value in options.items():
            option = known.get(name)
            if option is None:
                raise ConfigError(_unknown_option(name, known))
            sections.setdefault(option.section, {})[name] = _builtin(value)
        try:
            return msgspec.convert(sections, cls)
        except msgspec.ValidationError as exc:
            raise config_error(exc) from None

    def resolve_for_device(self, device_type: str) -> None:
        """Fill in, in place, the defaults that depend on the device
        (``"cpu"``, ``"cuda"``): ``max_num_batched_tokens``
        (:func:`cpu_max_num_batched_tokens` on the CPU with chunked prefill,
        else :data:`DEFAULT_MAX_NUM_BATCHED_TOKENS`: without chunked prefill
        the budget bounds the prompt), and on the CPU with one pipeline
        stage ``max_concurrent_batches`` 1 (see :class:`SchedulerConfig`).
        A value given is kept. Expert parallelism on a GPU needs
        ``cudagraph_mode`` NONE (ConfigError)."""
        scheduler, cpu = self.scheduler, device_type == "cpu"
        if scheduler.max_num_batched_tokens is None:
            small = cpu and scheduler.enable_chunked_prefill
            scheduler.max_num_batched_tokens = (
                cpu_max_num_batched_tokens() if small else DEFAULT_MAX_NUM_BATCHED_TOKENS
            )
        one_stage = self.parallel.pipeline_parallel_size == 1
        if scheduler.max_concurrent_batches == 0 and cpu and one_stage:
            scheduler.max_concurrent_batches = 1
        expert_parallel = self.parallel.enable_expert_parallel
        expert_parallel = expert_parallel and self.parallel.tensor_parallel_size > 1
        if expert_parallel and not cpu and self.compilation.cudagraph_mode != "NONE":
            raise ConfigError(
                "enable_expert_parallel runs eagerly (its all-to-all sizes are read on "
                "the host each step): pass cudagraph_mode none"
            )

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget, once resolved (ConfigError before)."""
        budget = self.scheduler.max_num_batched_tokens
        if budget is None:
            raise ConfigError(
                "max_num_batched_tokens must be resolved for the device (resolve_for_device) "
                "before the engine is built"
            )
        return budget

    @property
    def batch_queue_size(self) -> int:
        """Steps the engine keeps in flight: ``max_concurrent_batches`` if
        set, else 1 without overlap or pipeline, ``pp_size`` with a pipeline
        (every stage busy), at least 2 with overlap."""
        if self.scheduler.max_concurrent_batches:
            return self.scheduler.max_concurrent_batches
        pp = self.parallel.pipeline_parallel_size
        return max(2 if self.uses_output_placeholders else 1, pp)

    @property
    def max_num_running_reqs(self) -> int:
        """Requests that may run at once: ``max_num_seqs`` per step, times the
        steps in flight when these hold different requests (a pipeline)."""
        if self.uses_output_placeholders:
            return self.scheduler.max_num_seqs
        return self.scheduler.max_num_seqs * self.batch_queue_size

    @property
    def uses_output_placeholders(self) -> bool:
        """Async scheduling over output placeholders: the runners keep sampled
        ids on the device for the next step. One pipeline stage only: with
        pipeline parallelism the first stage needs every token's id. With
        speculative decoding a request's verify step runs alone in flight
        for it (see :mod:`asyncstep.engine.core.scheduler`)."""
        return self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size == 1

    @property
    def num_input_batches(self) -> int:
        """Persistent batches a runner keeps: one per step in flight whose
        requests differ from the others' (see :attr:`max_num_running_reqs`)."""
        return self.max_num_running_reqs // self.scheduler.max_num_seqs


def _builtin(value: object) -> object:
    """``value`` as msgspec's strict conversion takes it: a path as its str,
    a numpy (or other) integer or real as int or float, sequences item by item."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, bool | str | None):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, list | tuple):
        return [_builtin(v) for v in value]
    return value


def config_error(error: msgspec.DecodeError) -> ConfigError:
    """The one-line :class:`ConfigError` for a config msgspec refused: the
    section's own message when its ``__post_init__`` raised it (msgspec wraps
    a ``ValueError`` raised there in a ``ValidationError``), else msgspec's
    (the type expected and where, or what is malformed)."""
    if isinstance(error.__cause__, ConfigError):
        return ConfigError(str(error.__cause__))
    return ConfigError(f"bad engine config: {error}")


def decode_config(data: bytes) -> EngineConfig:
    """An :class:`EngineConfig` from msgpack; one :class:`ConfigError` if bad."""
    try:
        return msgspec.msgpack.decode(data, type=EngineConfig)
    except msgspec.DecodeError as exc:
        raise config_error(exc) from None


@dataclass(frozen=True)
class EngineOption:
    """One flat engine option: a field of a section of :class:`EngineConfig`."""

    #: The field's name: ``make_config``'s keyword (and the CLI's flag).
    name: str
    #: The section holding it: EngineConfig's field name (``"cache"``, ...).
    section: str
    #: The field's type (``int``, ``float | None``, ``list[int] | None``, ...).
    type: Any
    default: Any
    description: str
    #: The values allowed, when they are a fixed few.
    choices: tuple[Any, ...] | None = None

    @property
    def optional(self) -> bool:
        """None is a value of this option."""
        return type(None) in get_args(self.type)

    @property
    def value_type(self) -> Any:
        """The type without ``| None``."""
        args = [a for a in get_args(self.type) if a is not type(None)]
        return args[0] if self.optional and len(args) == 1 else self.type


@functools.cache
def engine_options() -> Mapping[str, EngineOption]:
    """Every field of every section, by name (names are unique across
    sections), in the order of the sections and their fields."""
    options: dict[str, EngineOption] = {}
    for section in msgspec.structs.fields(EngineConfig):
        for name, option in struct_options(section.type, section.name).items():
            if name in options:
                raise TypeError(f"engine option {name!r} is in two config sections")
            options[name] = option
    return MappingProxyType(options)


def struct_options(struct: type[msgspec.Struct], section: str) -> dict[str, EngineOption]:
    """The options of one config struct's fields (described as the engine's
    are, with ``msgspec.Meta(description=...)``), by name; ``section`` names
    the struct (the server's options use it too: ``asyncstep.server.config``)."""
    return {field.name: _option(section, field) for field in msgspec.structs.fields(struct)}


def _option(section: str, field: msgspec.structs.FieldInfo) -> EngineOption:
    kind, meta = field.type, None
    if get_origin(kind) is Annotated:
        kind, *extras = get_args(kind)
        meta = next((m for m in extras if isinstance(m, msgspec.Meta)), None)
    default = field.default
    if default is msgspec.NODEFAULT:
        default = field.default_factory()
    extra = (meta.extra if meta else None) or {}
    return EngineOption(
        name=field.name,
        section=section,
        type=kind,
        default=default,
        description=(meta.description if meta else None) or "",
        choices=extra.get("choices"),
    )


def _unknown_option(name: str, known: Mapping[str, EngineOption]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unknown engine option {name!r}{hint}"
