"""``open_engine``: load a model, size the KV cache, start the rank actor and
the engine's step loop in a task group, and hand the caller an :class:`Engine`.
``open_shared_engine`` / ``attach_engine``: one engine-core process, several
front ends in processes of their own (``asyncstep serve --api-server-count``)."""

from __future__ import annotations

import contextlib
import copy
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from asyncstep.config import EngineConfig
from asyncstep.engine.chat.chat_messages import use_chat_template
from asyncstep.engine.front_end.engine import Engine
from asyncstep.engine.front_end.input_processor import tokenizer_eos
from asyncstep.engine.transport.core_client import CoreClient, CoreConnection, CoreProcess
from asyncstep.errors import ConfigError, EngineDeadError, describe
from asyncstep.kv_cache_interface import kv_cache_groups
from asyncstep.logging import get_logger, json_log_file
from asyncstep.logging.spans import STARTUP, span

if TYPE_CHECKING:  # imported where used: they import torch, which a caller may not need
    from asyncstep.models.model_info import ModelInfo
    from asyncstep.models.model_loader import LoadedModel, ProgressFn

log = get_logger("engine")


def make_config(model: str | Path | None = None, **options: object) -> EngineConfig:
    """An :class:`EngineConfig` from flat keyword options (``open_engine``'s):
    each is a field of one of its sections, by the field's name
    (``block_size`` is ``cache.block_size``; the names, types, defaults and
    descriptions: :func:`asyncstep.config.engine_options`); the rest default.
    An unknown name or a bad value raises a one-line :class:`ConfigError`."""
    return EngineConfig.from_options(model=model, **options)


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
    Works under Trio and asyncio. By default (``engine_process=True``) the
    scheduler and the ranks run in an engine-core process of their own and
    this process keeps the tokenizer, detokenizer and the client streams; a
    ``LoadedModel`` always runs in this process. ``progress(done, total)`` is
    called as weights load. On exit, requests still in flight fail with
    :class:`EngineDeadError`; if the engine stopped on an error, leaving the
    block raises it as :class:`EngineDeadError`. A ``data_parallel_size``
    over 1 is :func:`~asyncstep.engine.front_end.data_parallel.open_data_parallel_engine`'s,
    unless ``data_parallel_rank`` says which one replica this engine is.
    """
    preloaded = _preloaded(model)
    if config is None:
        config = make_config(None if preloaded else model, **options)  # type: ignore[arg-type]
    elif options or model is not None:
        raise ConfigError("pass either config or model/options to open_engine, not both")
    else:
        config = copy.deepcopy(config)  # max_model_len is resolved in it: keep the caller's
    parallel = config.parallel
    if parallel.data_parallel_size > 1 and parallel.data_parallel_rank is None:
        raise ConfigError(
            "data_parallel_size > 1 opens several engines: use open_data_parallel_engine"
        )

    async with contextlib.AsyncExitStack() as stack:
        if preloaded is None and config.parallel.engine_process:
            process = _core_process(config, progress)
            stack.push_async_callback(process.discard)  # a no-op once it runs
            # The child imports while the tokenizer loads (after the layout check).
            info = await _describe(config, before_tokenizer=process.spawn_early)
            process.eos_token_ids = _eos_token_ids(info)
            arch, tokenizer = info.arch_config, info.tokenizer
            core: CoreClient = process
        else:
            from asyncstep.engine.core.engine_core import EngineCore
            from asyncstep.engine.executor.executor import open_executor

            opened = await stack.enter_async_context(open_executor(config, preloaded, progress))
            arch, tokenizer = opened.arch_config, opened.tokenizer
            use_chat_template(tokenizer, config.model.chat_template)
            eos = frozenset(arch.eos_token_ids) | tokenizer_eos(tokenizer)
            core = EngineCore(
                config,
                opened.executor,
                eos,
                vocab_size=arch.vocab_size,
                load_tokenizer=lambda: opened.tokenizer,
                kv_cache_groups=kv_cache_groups(arch.layer_windows),
            )
        async with _running(Engine(config, arch, tokenizer, core)) as engine:
            yield engine


@asynccontextmanager
async def open_shared_engine(
    config: EngineConfig,
    attach: Sequence[socket.socket],
    progress: ProgressFn | None = None,
    *,
    core_started: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[Engine]:
    """:func:`open_engine` with an engine-core process that also serves the
    front ends attached on ``attach`` (the core's ends of their socket
    pairs; each front end opens :func:`attach_engine` on the other end:
    they may start once ``core_started`` is called, as soon as the core's
    process is, and wait there for it to be ready). The engine returned is
    the primary front end: leaving the block stops the core."""
    config = copy.deepcopy(config)
    if not config.parallel.engine_process:
        raise ConfigError("front ends can share an engine core only in its own process")
    async with contextlib.AsyncExitStack() as stack:
        core = _core_process(config, progress, attach)
        stack.push_async_callback(core.discard)  # a no-op once it runs

        async def spawn() -> None:
            await core.spawn_early()
            if core_started is not None:
                await core_started()

        info = await _describe(config, before_tokenizer=spawn)
        core.eos_token_ids = _eos_token_ids(info)
        async with _running(Engine(config, info.arch_config, info.tokenizer, core)) as engine:
            yield engine


@asynccontextmanager
async def attach_engine(config: EngineConfig, fd: int, index: int) -> AsyncIterator[Engine]:
    """A front end (``Engine``) on the engine core that another process
    opened with :func:`open_shared_engine`, over the inherited socket ``fd``;
    ``index`` (from 1) tells its generated request ids apart. Its
    ``statistics()`` count its own tokens and finished requests, and the
    scheduler's figures as of its latest message (at most 50 ms old while it
    has nothing running). Leaving the block aborts its requests; the core
    keeps serving the others."""
    config = copy.deepcopy(config)
    info = await _describe(config)
    engine = Engine(
        config,
        info.arch_config,
        info.tokenizer,
        CoreConnection(fd),
        request_id_prefix=f"req-{index}-",
    )
    async with _running(engine) as running:
        yield running


async def _describe(
    config: EngineConfig, before_tokenizer: Callable[[], Awaitable[None]] | None = None
) -> ModelInfo:
    """The model's description (tokenizer included), its layout checked,
    ``config.model.max_model_len`` and the device's defaults resolved in
    place; ``before_tokenizer`` runs once the layout passed, before the
    tokenizer loads."""
    from asyncstep.models.model_info import (
        describe_model,
        device_type,
        model_arch,
        validate_parallel_layout,
    )

    with span("model_arch", STARTUP):
        opened = await anyio.to_thread.run_sync(model_arch, config.model)
    validate_parallel_layout(opened[0], config.parallel)
    if before_tokenizer is not None:
        await before_tokenizer()
    with span("tokenizer", STARTUP):
        info = await anyio.to_thread.run_sync(describe_model, config.model, opened)
    use_chat_template(info.tokenizer, config.model.chat_template)
    config.model.max_model_len = info.max_model_len
    config.resolve_for_device(device_type(config.model.device))
    return info


def _preloaded(model: object) -> LoadedModel | None:
    """``model`` if it is a :class:`LoadedModel` (only a process that
    imported the loader, and so torch, can hold one: nothing is imported)."""
    loader = sys.modules.get("asyncstep.models.model_loader")
    return model if loader is not None and isinstance(model, loader.LoadedModel) else None


def _core_process(
    config: EngineConfig,
    progress: ProgressFn | None,
    attach: Sequence[socket.socket] = (),
) -> CoreProcess:
    """The engine-core child for ``config`` (its end-of-sequence ids are
    set once the model is described: :func:`_eos_token_ids`)."""
    return CoreProcess(
        config,
        frozenset(),
        progress,
        log_level=config.parallel.rank_log_level,
        log_json=_core_log_json(config),
        attach=attach,
    )


def _eos_token_ids(info: ModelInfo) -> frozenset[int]:
    return frozenset(info.arch_config.eos_token_ids) | tokenizer_eos(info.tokenizer)


@asynccontextmanager
async def _running(engine: Engine) -> AsyncIterator[Engine]:
    """Serve ``engine`` in a task group for the block; closed on the way out."""
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


def _core_log_json(config: EngineConfig) -> str | None:
    """Where the engine-core process logs JSON lines: next to this process's
    JSON log (``FILE.core``), else next to the ranks' (``rank_log_json``)."""
    current = json_log_file()
    if current is not None:
        return f"{current}.core"
    if config.parallel.rank_log_json is not None:
        return f"{config.parallel.rank_log_json}.core"
    return None
