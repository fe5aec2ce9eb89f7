"""Run a PP x TP layout on fewer GPUs than ranks, for measurements and checks
on a machine smaller than the layout (the four-rank PP = 2 x TP = 2 on two
GPUs).

NCCL refuses a communicator that holds one GPU twice, so the ranks are laid
out with GPU ``(lane + stage) % num_gpus`` (rank = stage * tp + lane): every TP
group and every PP group then spans distinct GPUs, and stages share GPUs.
Numbers from such a layout measure the protocol and the code path; stages that
share a GPU also share its time, so its throughput is not a figure of the real
layout.

The ranks are started the way torchrun starts them (``python -m asyncstep.rank
--engine HOST:PORT`` with ``--local-rank`` = the GPU) against an engine opened
with ``launch_ranks=False``; both get a fresh secret in ``ASYNCSTEP_SECRET``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from asyncstep.channels.framing import SECRET_ENV, new_secret
from asyncstep.config import EngineConfig
from asyncstep.engine.front_end.api import make_config, open_engine
from asyncstep.engine.front_end.engine import Engine


def _free_port() -> int:
    """A port free a moment ago (the ranks must be told it before the engine
    listens; another process may take it in between: for tools only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_gpus(tp: int, pp: int, num_gpus: int) -> list[int]:
    """The GPU of each rank of a ``pp x tp`` layout on ``num_gpus`` GPUs.

    One GPU per rank when there are enough; otherwise ``(lane + stage) %
    num_gpus``. Raises ``ValueError`` when some TP or PP group would hold a
    GPU twice (fewer GPUs than ``max(tp, pp)``).
    """
    if tp < 1 or pp < 1 or num_gpus < 1:
        raise ValueError(f"tp, pp and num_gpus must be >= 1, got {tp}, {pp}, {num_gpus}")
    world = tp * pp
    if num_gpus >= world:
        return list(range(world))
    gpus = [(rank % tp + rank // tp) % num_gpus for rank in range(world)]
    groups = [[s * tp + lane for lane in range(tp)] for s in range(pp)]
    groups += [[s * tp + lane for s in range(pp)] for lane in range(tp)]
    for group in groups:
        if len({gpus[r] for r in group}) < len(group):
            raise ValueError(
                f"pp {pp} x tp {tp} cannot run on {num_gpus} GPUs: ranks {group} share a "
                f"communicator and would share a GPU (needs at least {max(tp, pp)} GPUs)"
            )
    return gpus


def start_ranks(
    engine_port: int,
    gpus: Sequence[int],
    master_port: int,
    *,
    log_json: str | None = None,
    log_level: str = "warning",
) -> list[subprocess.Popen[bytes]]:
    """Start one rank process per entry of ``gpus`` (rank ``i`` on GPU
    ``gpus[i]``) for the engine listening on ``127.0.0.1:engine_port`` (with
    this process's ``ASYNCSTEP_SECRET``)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
    processes = []
    for rank, gpu in enumerate(gpus):
        command = [
            sys.executable,
            "-m",
            "asyncstep.rank",
            "--engine",
            f"127.0.0.1:{engine_port}",
            "--rank",
            str(rank),
            "--world-size",
            str(len(gpus)),
            "--local-rank",
            str(gpu),
            "--log-level",
            log_level,
        ]
        if log_json is not None:
            command += ["--log-json", f"{log_json}.rank{rank}"]
        processes.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
    return processes


def stop_ranks(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """Wait for the ranks to exit (the engine told them to); kill stragglers."""
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.asynccontextmanager
async def open_config_on_gpus(config: EngineConfig, num_gpus: int) -> AsyncIterator[Engine]:
    """``asyncstep.open_engine(config=config)`` with its ranks laid out on
    ``num_gpus`` GPUs by :func:`rank_gpus` and started here; the config's
    ``rank_log_json`` (if set) becomes each rank's ``--log-json`` prefix."""
    parallel = config.parallel
    gpus = rank_gpus(parallel.tensor_parallel_size, parallel.pipeline_parallel_size, num_gpus)
    port = _free_port()
    config = msgspec.structs.replace(
        config,
        parallel=msgspec.structs.replace(
            parallel, launch_ranks=False, listen=f"127.0.0.1:{port}", rank_log_json=None
        ),
    )
    previous = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = new_secret()  # the ranks' and the engine core's
    processes = start_ranks(port, gpus, _free_port(), log_json=parallel.rank_log_json)
    try:
        async with open_engine(config=config) as engine:
            yield engine
    finally:
        if previous is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = previous
        await trio.to_thread.run_sync(stop_ranks, processes)


@contextlib.asynccontextmanager
async def open_engine_on_gpus(
    model: str | Path | None, num_gpus: int, **options: Any
) -> AsyncIterator[Engine]:
    """:func:`open_config_on_gpus` of ``make_config(model, **options)``."""
    async with open_config_on_gpus(make_config(model, **options), num_gpus) as engine:
        yield engine
