"""``open_engine``: load a model, size the KV cache, start the rank actor and
the engine's step loop in a task group, and hand the caller an :class:`Engine`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import torch

from asyncstep.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from asyncstep.engine.engine import Engine
from asyncstep.errors import ConfigError, EngineDeadError
from asyncstep.logging import get_logger
from asyncstep.models.model_loader import (
    LoadedModel,
    ProgressFn,
    load_model,
    resolve_max_model_len,
)
from asyncstep.nursery import RankActor
from asyncstep.runner.model_runner import ModelRunner

log = get_logger("engine")

#: GPU memory kept back for activations, beyond the estimate from the batch shape.
ACTIVATION_RESERVE_BYTES = 1 << 30


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
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
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
        scheduler=SchedulerConfig(max_num_batched_tokens, max_num_seqs, enable_chunked_prefill),
        parallel=ParallelConfig(tensor_parallel_size, pipeline_parallel_size),
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
    if config.parallel.world_size != 1:
        raise ConfigError("tensor and pipeline parallelism need the multi-rank launcher")
    if preloaded is None:
        loaded = await anyio.to_thread.run_sync(load_model, config.model, progress)
    else:
        loaded = preloaded
    with loaded.claim():
        config.scheduler.max_model_len = (
            resolve_max_model_len(config.model.max_model_len, loaded.arch_config)
            if preloaded
            else loaded.max_model_len
        )
        runner = _build_runner(config, loaded)
        engine = Engine(config, loaded.arch_config, loaded.tokenizer, runner.num_kv_blocks)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(engine.serve, RankActor(runner))
                try:
                    yield engine
                finally:
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
        raise EngineDeadError(f"the engine stopped: {engine.error}") from engine.error


def _build_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    runner = ModelRunner(
        loaded.model,
        device=loaded.device,
        dtype=loaded.dtype,
        max_model_len=config.scheduler.max_model_len,
        max_num_reqs=config.scheduler.max_num_seqs,
        block_size=config.cache.block_size,
    )
    num_blocks = num_kv_blocks(config, runner, loaded)
    runner.initialize_kv_cache(num_blocks)
    log.info(
        "kv cache ready",
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        tokens=num_blocks * config.cache.block_size,
        gib=round(num_blocks * runner.kv_cache_block_bytes() / 2**30, 3),
    )
    return runner


def num_kv_blocks(config: EngineConfig, runner: ModelRunner, loaded: LoadedModel) -> int:
    """How many KV blocks to allocate: as configured, else what the memory allows
    (never more than ``max_num_seqs`` full-length sequences need)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    block_bytes = runner.kv_cache_block_bytes()
    if loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        arch = loaded.arch_config
        activations = (
            config.scheduler.max_num_batched_tokens
            * ((4 * arch.hidden_size + 2 * arch.intermediate_size) * loaded.dtype.itemsize)
            + config.scheduler.max_num_seqs * arch.vocab_size * 4 * 3
        )
        budget = free - (1 - cache.gpu_memory_utilization) * total - activations
        budget -= ACTIVATION_RESERVE_BYTES
    else:
        budget = cache.kv_cache_memory_gib * 2**30
    blocks_per_seq = -(-config.scheduler.max_model_len // cache.block_size)
    num_blocks = min(int(budget // block_bytes), config.scheduler.max_num_seqs * blocks_per_seq)
    if num_blocks < blocks_per_seq and num_blocks < 16:
        raise ConfigError(
            f"no memory left for the KV cache ({num_blocks} blocks); lower max_model_len "
            "or raise the KV cache memory"
        )
    return num_blocks
