"""Engine configuration: model, cache, scheduler and parallel settings.

Plain dataclasses, validated on construction with one-line
:class:`~asyncstep.errors.ConfigError` messages. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asyncstep.errors import ConfigError

LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Which weights to run, and where.

    ``model`` is a GGUF file, an HF checkpoint directory, or None for the
    embedded default (SmolLM2-135M-Instruct). With ``load_format="dummy"``,
    ``model`` names a shape (see ``asyncstep.models.loader.dummy``) or an HF
    directory whose config is used with random weights.
    """

    model: str | Path | None = None
    load_format: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    #: Longest sequence (prompt + output); None: the model's own limit.
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how many blocks."""

    block_size: int = 16
    #: Number of KV blocks; None: as many as ``kv_cache_memory_gib`` (CPU) or
    #: ``gpu_memory_utilization`` (CUDA) allows.
    num_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True

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


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    #: Token budget of one step (prompt chunks + decodes).
    max_num_batched_tokens: int = 2048
    #: Most requests in one step. With pipeline parallelism each of the
    #: ``pp_size`` steps in flight holds different requests, so up to
    #: ``pp_size * max_num_seqs`` run at once (vLLM v0's virtual engines).
    max_num_seqs: int = 64
    #: Split long prompts over several steps (chunked prefill).
    enable_chunked_prefill: bool = True
    #: Filled in from the model when the engine starts.
    max_model_len: int = 0
    #: Overlap: schedule one step ahead (the forward of step N+1 runs while
    #: step N is sampled and delivered). False runs steps one at a time.
    async_scheduling: bool = True
    #: Steps the engine keeps in flight (its batch queue); 0 chooses: 1
    #: without overlap, 2 with it (step N+1 launched while step N is
    #: sampled), ``pp_size`` with pipeline parallelism. With overlap, 3 also
    #: hides the engine's update and schedule of a step behind the device
    #: (a stop is then found two steps late: the extra tokens are dropped).
    max_concurrent_batches: int = 0
    #: ``sys.setswitchinterval`` while a rank serves (None: Python's 5 ms).
    #: The launch thread and the event loop share the GIL; a short interval
    #: keeps their hand-offs from stalling the device.
    gil_switch_interval_s: float | None = 0.0005

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
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


@dataclass
class ParallelConfig:
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

    ``pp_tensor_lanes``: between pipeline stages with TP, each TP rank sends
    ``1 / tp_size`` of every replicated tensor to its peer and the receiving
    stage all-gathers (vLLM's way; pays where the stage-to-stage link is slower
    than the links inside a stage, e.g. stages on different hosts). False: each
    TP rank sends its whole tensors, no gather (measured faster on one NVLink
    host: ``benchmarks/results/layout/``).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_parallel: bool = False
    launch_ranks: bool = True
    listen: str = "127.0.0.1:0"
    #: Console log level of the rank processes.
    rank_log_level: str = "warning"
    #: Started ranks write every event (step-timeline spans too) as JSON lines
    #: to ``<rank_log_json>.rank<N>``.
    rank_log_json: str | None = None
    pp_tensor_lanes: bool = True

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"listen must be HOST:PORT, got {self.listen!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class CompilationConfig:
    """How a step's forward runs on the device (vLLM's ``CompilationConfig``).

    ``cudagraph_mode``: NONE (eager), PIECEWISE (every batch in graphs cut at
    attention, which runs eagerly between them), FULL (whole forward in one
    graph, any batch shape), FULL_DECODE_ONLY (FULL for uniform decode
    batches, eager otherwise), FULL_AND_PIECEWISE (FULL for uniform decode,
    PIECEWISE for the rest; the default). CUDA graphs need a CUDA device and
    the Triton attention backend; elsewhere the mode falls back to NONE.

    ``cudagraph_capture_sizes``: token counts captured (batches are padded up
    to the next one); None: ``[1, 2, 4] + 8, 16, ..., 256 + 272, 288, ...``
    up to ``max_cudagraph_capture_size`` (None: ``min(2 * max_num_seqs,
    512)``). ``attention_backend``: auto (triton on CUDA, torch on the CPU).
    ``ubatch_*``: micro-batching (two micro-batches whose TP communication
    overlaps each other's compute); off by default.
    """

    cudagraph_mode: str = "FULL_AND_PIECEWISE"
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    attention_backend: str = "auto"
    #: With the Triton backend, also fuse residual add + RMSNorm, and rotary.
    fused_kernels: bool = True
    enable_ubatching: bool = False
    ubatch_decode_threshold: int = 32
    ubatch_prefill_threshold: int = 512
    #: Run the graph modes without CUDA, replaying a "graph" by calling the
    #: captured function again (tests the padding and cuts on the CPU).
    cudagraph_stand_in: bool = False

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


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)

    @property
    def batch_queue_size(self) -> int:
        """Steps the engine keeps in flight: ``max_concurrent_batches`` if
        set, else 1 without overlap or pipeline, ``pp_size`` with a pipeline
        (every stage busy), at least 2 with overlap."""
        if self.scheduler.max_concurrent_batches:
            return self.scheduler.max_concurrent_batches
        pp = self.parallel.pipeline_parallel_size
        return max(2 if self.scheduler.async_scheduling else 1, pp)

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
        pipeline parallelism the first stage needs every token's id."""
        return self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size == 1
