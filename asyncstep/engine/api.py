"""``open_engine``: load a model, size the KV cache, start the rank actor and
the engine's step loop in a task group, and hand the caller an :class:`Engine`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from asyncstep.channels.control import RankSpec
from asyncstep.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from asyncstep.engine.engine import Engine, Executor
from asyncstep.engine.remote import RemoteRanks
from asyncstep.errors import ConfigError, EngineDeadError, describe
from asyncstep.gpu import switch_interval
from asyncstep.logging import get_logger
from asyncstep.models.model_info import describe_model, validate_parallel_layout
from asyncstep.models.model_loader import (
    LoadedModel,
    ProgressFn,
    load_model,
    resolve_max_model_len,
)
from asyncstep.nursery import RankActor
from asyncstep.runner.capture import capture_cuda_graphs
from asyncstep.runner.kv_sizing import num_kv_blocks
from asyncstep.runner.model_runner import ModelRunner

log = get_logger("engine")


def make_config(
    model: str | Path | None = None,
    *,
    load_format: str = "auto",
    dtype: str = "auto",
    device: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_memory_gib: float = 1.0,
    gpu_memory_utilization: float = 0.85,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = True,
    max_concurrent_batches: int = 0,
    gil_switch_interval_s: float | None = 0.0005,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    sequence_parallel: bool = False,
    launch_ranks: bool = True,
    listen: str = "127.0.0.1:0",
    rank_log_level: str = "warning",
    rank_log_json: str | None = None,
    pp_tensor_lanes: bool = True,
    cudagraph_mode: str = "FULL_AND_PIECEWISE",
    cudagraph_capture_sizes: list[int] | None = None,
    max_cudagraph_capture_size: int | None = None,
    attention_backend: str = "auto",
    fused_kernels: bool = True,
    enable_ubatching: bool = False,
    ubatch_decode_threshold: int = 32,
    ubatch_prefill_threshold: int = 512,
    cudagraph_stand_in: bool = False,
) -> EngineConfig:
    """An :class:`EngineConfig` from flat keyword options (``open_engine``'s)."""
    return EngineConfig(
        model=ModelConfig(model, load_format, dtype, device, max_model_len, seed),
        cache=CacheConfig(
            block_size,
            num_blocks,
            kv_cache_memory_gib,
            gpu_memory_utilization,
            enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens,
            max_num_seqs,
            enable_chunked_prefill,
            async_scheduling=async_scheduling,
            max_concurrent_batches=max_concurrent_batches,
            gil_switch_interval_s=gil_switch_interval_s,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size,
            pipeline_parallel_size,
            sequence_parallel,
            launch_ranks,
            listen,
            rank_log_level,
            rank_log_json,
            pp_tensor_lanes,
        ),
        compilation=CompilationConfig(
            cudagraph_mode,
            cudagraph_capture_sizes,
            max_cudagraph_capture_size,
            attention_backend,
            fused_kernels,
            enable_ubatching,
            ubatch_decode_threshold,
            ubatch_prefill_threshold,
            cudagraph_stand_in,
        ),
    )


@asynccontextmanager
async def open_engine(
    model: str | Path | LoadedModel | None = None,
    *,
    config: EngineConfig | None = None,
    progress: ProgressFn | None = None,
    **options: object,
) -> AsyncIterator[Engine]:
    """Start an engine serving ``model`` (a GGUF file, an HF checkpoint
    directory, or None for the embedded SmolLM2-135M-Instruct; or a
    :class:`LoadedModel` from ``load_model``, to reuse weights across engines
    that run one after another).

    ``options`` are :func:`make_config`'s keywords; or pass a whole ``config``.
    Works under Trio and asyncio. Weights load in a worker thread;
    ``progress(done, total)`` is called as they do. On exit, requests still in
    flight fail with :class:`EngineDeadError`; if the engine stopped on an
    error, leaving the block raises it as :class:`EngineDeadError`.
    """
    preloaded = model if isinstance(model, LoadedModel) else None
    if config is None:
        config = make_config(None if preloaded else model, **options)  # type: ignore[arg-type]
    elif options or model is not None:
        raise ConfigError("pass either config or model/options to open_engine, not both")
    if config.parallel.world_size == 1:
        if preloaded is None:
            loaded = await anyio.to_thread.run_sync(load_model, config.model, progress)
        else:
            loaded = preloaded
        claim: contextlib.AbstractContextManager[None] = loaded.claim()
        if preloaded is not None:
            max_model_len = resolve_max_model_len(config.model.max_model_len, loaded.arch_config)
        else:
            max_model_len = loaded.max_model_len
        config.scheduler.max_model_len = max_model_len
        runner = _build_runner(config, loaded)
        await anyio.to_thread.run_sync(capture_cuda_graphs, runner)
        executor: Executor = RankActor(runner)
        claim = _freeing_kv_cache(claim, runner)
        claim = _chained(claim, switch_interval(config.scheduler.gil_switch_interval_s))
        arch, tokenizer = loaded.arch_config, loaded.tokenizer
    else:
        if preloaded is not None:
            raise ConfigError("a LoadedModel serves one rank; pass a model path for TP/PP")
        info = await anyio.to_thread.run_sync(describe_model, config.model)
        validate_parallel_layout(info.arch_config, config.parallel)
        config.scheduler.max_model_len = info.max_model_len
        executor = remote_ranks(config)
        arch, tokenizer, claim = info.arch_config, info.tokenizer, contextlib.nullcontext()
    engine = Engine(config, arch, tokenizer, executor)
    with claim:
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.serve)
                try:
                    yield engine
                finally:
                    with anyio.CancelScope(shield=True):
                        await engine.aclose()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The engine's own tasks never raise out (a failure ends requests
            # with EngineDeadError), so a group holds the caller's one error:
            # give it back as it was raised.
            if len(group.exceptions) == 1:
                error = group.exceptions[0]
                raise error from error.__cause__
            raise
    if engine.error is not None:
        raise EngineDeadError(f"the engine stopped: {describe(engine.error)}") from engine.error


@contextlib.contextmanager
def _freeing_kv_cache(
    claim: contextlib.AbstractContextManager[None], runner: ModelRunner
) -> Iterator[None]:
    with claim:
        try:
            yield
        finally:
            runner.free_kv_cache()


@contextlib.contextmanager
def _chained(
    outer: contextlib.AbstractContextManager[None], inner: contextlib.AbstractContextManager[None]
) -> Iterator[None]:
    with outer, inner:
        yield


def remote_ranks(config: EngineConfig) -> RemoteRanks:
    """The ranks of a TP x PP engine, in their own processes."""
    model, parallel = config.model, config.parallel
    spec = RankSpec(
        model=None if model.model is None else str(model.model),
        load_format=model.load_format,
        dtype=model.dtype,
        device=model.device,
        max_model_len=config.scheduler.max_model_len,
        seed=model.seed,
        block_size=config.cache.block_size,
        num_blocks=config.cache.num_blocks,
        kv_cache_memory_gib=config.cache.kv_cache_memory_gib,
        gpu_memory_utilization=config.cache.gpu_memory_utilization,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_running_reqs=config.max_num_running_reqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        gil_switch_interval_s=config.scheduler.gil_switch_interval_s,
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        pp_tensor_lanes=parallel.pp_tensor_lanes,
        async_scheduling=config.uses_output_placeholders,
        cudagraph_mode=config.compilation.cudagraph_mode,
        cudagraph_capture_sizes=config.compilation.cudagraph_capture_sizes,
        max_cudagraph_capture_size=config.compilation.max_cudagraph_capture_size,
        attention_backend=config.compilation.attention_backend,
        fused_kernels=config.compilation.fused_kernels,
        enable_ubatching=config.compilation.enable_ubatching,
        ubatch_decode_threshold=config.compilation.ubatch_decode_threshold,
        ubatch_prefill_threshold=config.compilation.ubatch_prefill_threshold,
        cudagraph_stand_in=config.compilation.cudagraph_stand_in,
    )
    host, _, port = parallel.listen.rpartition(":")
    return RemoteRanks(
        spec,
        launch=parallel.launch_ranks,
        listen_host=host,
        listen_port=int(port),
        log_level=parallel.rank_log_level,
        log_json=parallel.rank_log_json,
    )


def _build_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    runner = ModelRunner(
        loaded.model,
        device=loaded.device,
        dtype=loaded.dtype,
        max_model_len=config.scheduler.max_model_len,
        max_num_reqs=config.scheduler.max_num_seqs,
        block_size=config.cache.block_size,
        async_scheduling=config.uses_output_placeholders,
        compilation=config.compilation,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        graph_stand_in=config.compilation.cudagraph_stand_in,
        num_input_batches=config.max_num_running_reqs // config.scheduler.max_num_seqs,
    )
    num_blocks = num_kv_blocks(
        config.cache,
        block_bytes=runner.kv_cache_block_bytes(),
        max_model_len=config.scheduler.max_model_len,
        max_num_running_reqs=config.max_num_running_reqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        arch=loaded.arch_config,
        device=loaded.device,
        dtype=loaded.dtype,
    )
    runner.initialize_kv_cache(num_blocks)
    log.info(
        "kv cache ready",
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        tokens=num_blocks * config.cache.block_size,
        gib=round(num_blocks * runner.kv_cache_block_bytes() / 2**30, 3),
    )
    return runner
