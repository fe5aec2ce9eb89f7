"""The executor of a layout: the in-process rank actor (one rank), or the
rank processes (TP x PP), with the model loaded and the KV cache sized.

Used by the engine core, in whichever process it runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from asyncstep.config import EngineConfig
from asyncstep.device import switch_interval
from asyncstep.engine.core.engine_core import Executor
from asyncstep.engine.executor.remote import RemoteRanks
from asyncstep.errors import ConfigError
from asyncstep.logging import get_logger
from asyncstep.logging.spans import CORE_STARTUP, span
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.model_info import (
    describe_model,
    device_type,
    resolve_max_model_len,
    validate_parallel_layout,
)
from asyncstep.models.model_loader import LoadedModel, ProgressFn, load_model
from asyncstep.nursery import RankActor
from asyncstep.runner.build import build_runner, kv_cache_blocks, resolved_max_model_len
from asyncstep.runner.capture import capture_cuda_graphs
from asyncstep.runner.cpu_threads import run_in_ending_thread
from asyncstep.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = get_logger("engine")


@dataclass(frozen=True)
class OpenedExecutor:
    executor: Executor
    arch_config: ModelArchConfig
    tokenizer: PreTrainedTokenizerBase | None


@asynccontextmanager
async def open_executor(
    config: EngineConfig,
    preloaded: LoadedModel | None = None,
    progress: ProgressFn | None = None,
    *,
    with_tokenizer: bool = True,
) -> AsyncIterator[OpenedExecutor]:
    """The executor of ``config``'s layout, ready to run; ``config.model.max_model_len``
    is resolved from the model, the device's defaults filled in
    (:meth:`EngineConfig.resolve_for_device`). One rank: the model (or ``preloaded``) loads
    here, the KV cache is allocated and CUDA graphs captured; all is freed on
    exit. Several: the ranks are processes of their own (:class:`RemoteRanks`),
    started when the executor runs."""
    if config.parallel.world_size > 1:
        if preloaded is not None:
            raise ConfigError("a LoadedModel serves one rank; pass a model path for TP/PP")
        info = await anyio.to_thread.run_sync(describe_model, config.model)
        validate_parallel_layout(info.arch_config, config.parallel)
        config.model.max_model_len = info.max_model_len
        config.resolve_for_device(device_type(config.model.device))
        yield OpenedExecutor(remote_ranks(config), info.arch_config, info.tokenizer)
        return
    if preloaded is None:
        with span("load_model", CORE_STARTUP):
            loaded = await run_in_ending_thread(
                lambda: load_model(config.model, progress, with_tokenizer=with_tokenizer)
            )
        max_model_len = loaded.max_model_len
    else:
        loaded = preloaded
        max_model_len = resolve_max_model_len(config.model.max_model_len, loaded.arch_config)
    config.model.max_model_len = max_model_len
    config.resolve_for_device(loaded.device.type)
    with loaded.claim():
        with span("kv_cache", CORE_STARTUP):
            runner = await run_in_ending_thread(lambda: _build_runner(config, loaded))
        try:
            with span("cuda_graphs", CORE_STARTUP):
                await anyio.to_thread.run_sync(capture_cuda_graphs, runner)
            with switch_interval(config.scheduler.gil_switch_interval_s):
                actor = RankActor(runner, launch_inline=config.compilation.launch_inline)
                yield OpenedExecutor(actor, loaded.arch_config, loaded.tokenizer)
        finally:
            runner.free_kv_cache()


def remote_ranks(config: EngineConfig) -> RemoteRanks:
    """The ranks of a TP x PP engine, in their own processes; each is handed
    the whole ``config`` (``model.max_model_len`` resolved)."""
    resolved_max_model_len(config)
    return RemoteRanks(config)


def _build_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    """The one-rank runner of ``loaded``, its KV cache allocated as ``config``
    says (``model.max_model_len`` resolved)."""
    runner = build_runner(config, loaded)
    num_blocks = kv_cache_blocks(config, runner, loaded)
    runner.initialize_kv_cache(num_blocks)
    log.info(
        "kv cache ready",
        num_blocks=num_blocks,
        block_size=config.cache.block_size,
        tokens=num_blocks * config.cache.block_size,
        gib=round(num_blocks * runner.kv_cache_block_bytes() / 2**30, 3),
    )
    return runner
