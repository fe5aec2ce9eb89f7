"""What the modes that open an engine share: logging from ``-v`` and
``--log-json``, the engine (its ranks started here on fewer GPUs with
``--rank-gpus``), its warm-up, the device and dtype, HF's options and the
copy bandwidth."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from asyncstep.config import EngineConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.front_end.api import open_engine
from asyncstep.engine.front_end.engine import Engine
from asyncstep.logging import configure_logging

if TYPE_CHECKING:
    import torch

    from asyncstep.bench.hf import HfOptions


def log_level(args: argparse.Namespace) -> str:
    return ("warning", "info", "debug")[min(args.verbose, 2)]


def configure(args: argparse.Namespace) -> None:
    """Logging as ``asyncstep generate`` sets it from ``-v`` and ``--log-json``."""
    configure_logging(log_level(args), args.log_json)


def progress(line: str) -> None:
    """A progress line (stderr: stdout holds the table)."""
    print(line, file=sys.stderr, flush=True)


@asynccontextmanager
async def bench_engine(config: EngineConfig, rank_gpus: int | None) -> AsyncIterator[Engine]:
    """The engine of ``config``: its own ranks, or ranks started here on
    ``rank_gpus`` GPUs."""
    if rank_gpus is not None:
        from asyncstep.bench.rank_gpus import open_config_on_gpus

        async with open_config_on_gpus(config, rank_gpus) as engine:
            yield engine
    else:
        async with open_engine(config=config) as engine:
            yield engine


async def warm_up(engine: Engine, seed: int) -> None:
    """One short request (the first step's kernels and graphs)."""
    from asyncstep.bench.workload import random_prompts

    prompt = random_prompts(engine.arch_config.vocab_size, [8], seed)[0]
    await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype the engine resolves ``config``'s to."""
    from asyncstep.models.loader import open_checkpoint
    from asyncstep.models.model_loader import cpu_blocks_fit, resolve_device, resolve_dtype

    model = config.model
    device = resolve_device(model.device)
    checkpoint = None
    if model.load_format != "dummy" and model.dtype == "auto" and device.type == "cpu":
        checkpoint = open_checkpoint(model.model, model.load_format)
    fit = cpu_blocks_fit(model, checkpoint, device)
    return device, resolve_dtype(model.dtype, device, cpu_blocks_fit=fit)


def hf_options(args: argparse.Namespace, config: EngineConfig) -> HfOptions:
    from pathlib import Path

    from asyncstep.bench.hf import HfOptions

    device, dtype = device_dtype(config)
    compile_ = device.type == "cuda" if args.hf_compile is None else args.hf_compile
    return HfOptions(
        device=device,
        dtype=dtype,
        compile=compile_,
        warmups=args.hf_warmups,
        repeats=args.hf_repeats,
        skip=not args.hf,
        quote_from=Path(args.hf_from) if args.hf_from else None,
    )


def bandwidth(args: argparse.Namespace, config: EngineConfig) -> float | None:
    """The device's copy bandwidth (bytes/s), None with ``--no-floor``."""
    if not args.floor:
        return None
    from asyncstep.bench.floor import copy_bandwidth

    device, _ = device_dtype(config)
    gib = args.copy_gib if args.copy_gib is not None else (1.0 if device.type == "cuda" else 1 / 16)
    found = copy_bandwidth(device, gib, args.copy_repeats)
    progress(f"copy bandwidth on {device}: {found / 1e12:.3f} TB/s")
    return found


def engine_summary(config: EngineConfig) -> dict[str, Any]:
    """The few options a table's title shows."""
    model = config.model
    parallel = config.parallel
    return {
        "model": model.model or "smollm2-135m",
        "load_format": model.load_format,
        "dtype": model.dtype,
        "device": model.device,
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
    }
