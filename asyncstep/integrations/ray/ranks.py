"""An engine whose ranks are Ray actors (vLLM's
``--distributed-executor-backend ray``): :func:`open_ray_engine`.

The launch is the torchrun recipe of ``docs/parallelism.md``, done by Ray:

1. one bundle per rank is reserved (:mod:`~asyncstep.integrations.ray.placement`);
2. one :class:`~asyncstep.integrations.ray.rank_worker.RankWorker` actor is
   started in each bundle;
3. the first actor names the rendezvous: its node's address (loopback when
   every rank shares a node) and a free port there (``MASTER_ADDR`` /
   ``MASTER_PORT``; torch.distributed over gloo on the CPU, NCCL on CUDA);
4. the engine core's control address is this process's node (loopback
   when every rank is on it; ``listen`` when it names a port), the secret
   this process's ``ASYNCSTEP_SECRET`` or a new one, set there for the
   engine core to read;
5. each actor runs ``python -m asyncstep.rank``'s entry, which connects to
   that address, passes the handshake and serves steps; the engine is
   opened with ``launch_ranks=False`` and waits for them, as for torchrun.

The engine core runs where this is called: in this process or its child
(``engine_process``), on whichever node Ray placed the caller (a Serve
replica, a task, the driver). Leaving the block stops the engine; the ranks
then end in order, the actors are killed and the bundles given back, however
the block ended. A rank's failure ends the engine with its
:class:`~asyncstep.errors.RankError`, as with ranks in processes; the
actors are owned by this process and die with it (Ray's fate sharing).

Imports ray when :func:`open_ray_engine` runs.
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from asyncstep import Engine, open_engine
from asyncstep.channels.framing import SECRET_ENV, new_secret
from asyncstep.config import EngineConfig
from asyncstep.errors import ConfigError
from asyncstep.integrations.ray.placement import (
    RankSlots,
    RayPlacement,
    release,
    reserve,
    scheduling,
)
from asyncstep.integrations.ray.rank_worker import RankWorker
from asyncstep.logging import get_logger

log = get_logger("engine")

#: Seconds a rank keeps trying the engine's address (the engine core may
#: still be importing when the actors are up).
CONNECT_TIMEOUT_S = 300.0
#: Seconds the ranks get to end in order once the engine stopped.
EXIT_TIMEOUT_S = 15.0


@asynccontextmanager
async def open_ray_engine(
    model: str | Path | None = None,
    *,
    config: EngineConfig | None = None,
    placement: RayPlacement | None = None,
    **options: object,
) -> AsyncIterator[Engine]:
    """:func:`asyncstep.open_engine` with the ranks as Ray actors (see the
    module's docstring), on the Ray cluster this process joined
    (``ray.init()`` first: else :class:`ConfigError`). ``model``,
    ``options`` and ``config`` are ``open_engine``'s; ``placement`` places
    the ranks (default :class:`RayPlacement`). One rank (TP = PP = 1) needs
    no actor: the engine opens as ``open_engine`` opens it."""
    if config is None:
        config = EngineConfig.from_options(model=model, **options)
    elif options or model is not None:
        raise ConfigError("pass either config or model/options to open_ray_engine, not both")
    else:
        config = copy.deepcopy(config)
    if config.parallel.world_size == 1:
        async with open_engine(config=config) as engine:
            yield engine
        return
    async with (
        ray_ranks(config, placement or RayPlacement()) as engine_config,
        open_engine(config=engine_config) as engine,
    ):
        yield engine


@asynccontextmanager
async def ray_ranks(config: EngineConfig, placement: RayPlacement) -> AsyncIterator[EngineConfig]:
    """The ranks of ``config`` started as Ray actors, waiting for their
    engine: the config to open it with (``launch_ranks`` off, ``listen``
    the address they connect to). Stopped and released on the way out."""
    import ray

    if not ray.is_initialized():
        raise ConfigError("ranks as Ray actors need a Ray cluster: call ray.init() first")
    slots = await anyio.to_thread.run_sync(reserve, config, placement)
    actors: list[Any] = []
    done: list[Any] = []
    try:
        actor_class = ray.remote(RankWorker)
        for rank in range(config.parallel.world_size):
            options = {"scheduling_strategy": scheduling(slots, rank), "max_concurrency": 2}
            options.update(_resources(placement.bundle(config)))
            actors.append(actor_class.options(**options).remote())
        engine_config, argvs, env = await _launch_plan(config, actors, placement.rank_env)
        done = [actor.serve.remote(argv, env) for actor, argv in zip(actors, argvs, strict=True)]
        log.info(
            "ranks started as Ray actors",
            world_size=len(actors),
            engine=engine_config.parallel.listen,
            rendezvous=f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
        )
        yield engine_config
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_stop, actors, done, slots)


def _resources(bundle: dict[str, float]) -> dict[str, float]:
    """An actor's resource options for ``bundle`` (it takes all of it)."""
    return {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}


async def _launch_plan(
    config: EngineConfig, actors: Sequence[Any], rank_env: dict[str, str]
) -> tuple[EngineConfig, list[list[str]], dict[str, str]]:
    """The engine's config, each rank's command line and the ranks'
    environment (see the module's docstring, steps 3 to 5)."""
    import ray

    places = await _get([actor.where.remote() for actor in actors])
    nodes = {node for node, _ in places}
    here = ray.get_runtime_context().get_node_id()
    master_host = "127.0.0.1" if len(nodes) == 1 else places[0][1]
    master_port = await _get(actors[0].free_port.remote(master_host))
    host, port = config.parallel.listen_address
    if port == 0:
        host = "127.0.0.1" if nodes == {here} else ray.util.get_node_ip_address()
        port = _free_port(host)
    connect = ray.util.get_node_ip_address() if host in ("", "0.0.0.0", "::") else host
    engine_config = copy.deepcopy(config)
    engine_config.parallel.launch_ranks = False
    engine_config.parallel.listen = f"{host}:{port}"
    env = _loopback_sockets() if len(nodes) == 1 and master_host == "127.0.0.1" else {}
    env.update(rank_env)
    env.update(MASTER_ADDR=master_host, MASTER_PORT=str(master_port))
    env[SECRET_ENV] = _secret()
    argvs = [_rank_argv(config, f"{connect}:{port}", rank) for rank in range(len(actors))]
    return engine_config, argvs, env


def _rank_argv(config: EngineConfig, engine: str, rank: int) -> list[str]:
    """``python -m asyncstep.rank``'s arguments for ``rank``: local rank 0,
    since Ray shows each actor its own GPUs only (``CUDA_VISIBLE_DEVICES``)."""
    parallel = config.parallel
    argv = ["--engine", engine, "--rank", str(rank), "--world-size", str(parallel.world_size)]
    argv += ["--local-rank", "0", "--log-level", parallel.rank_log_level]
    argv += ["--connect-timeout", str(CONNECT_TIMEOUT_S)]
    if parallel.rank_log_json is not None:
        argv += ["--log-json", f"{parallel.rank_log_json}.rank{rank}"]
    return argv


def _secret() -> str:
    """The launch's secret: this process's ``ASYNCSTEP_SECRET``, else a new
    one put there (the engine core, here or in a child, reads it there)."""
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        secret = os.environ[SECRET_ENV] = new_secret()
    return secret


def _loopback_sockets() -> dict[str, str]:
    """gloo's and NCCL's sockets on loopback, for ranks that share a node
    (unless this process chose an interface)."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is None:
        return {}
    keys = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    return {key: os.environ.get(key, loopback) for key in keys}


def _free_port(host: str) -> int:
    """A port on ``host`` free a moment ago, for the engine's listener
    (named to the ranks before the engine core binds it: give ``listen`` a
    port of your own where another process might take it in between)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def _get(refs: Any) -> Any:
    """``ray.get`` off the event loop."""
    import ray

    return await anyio.to_thread.run_sync(ray.get, refs)


def _stop(actors: Sequence[Any], done: Sequence[Any], slots: RankSlots) -> None:
    """Wait a while for the ranks to end in order (the engine told them),
    then kill the actors and give the bundles back (blocking)."""
    import ray

    try:
        if done:
            ready, _ = ray.wait(list(done), num_returns=len(done), timeout=EXIT_TIMEOUT_S)
            for ref in ready:
                try:
                    status = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    log.warning("a Ray rank ended with an error", error=str(exc).splitlines()[0])
                else:
                    if status != 0:
                        log.warning("a Ray rank exited with a failure", status=status)
        for actor in actors:
            ray.kill(actor, no_restart=True)
    finally:
        release(slots)
