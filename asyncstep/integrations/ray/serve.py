"""asyncstep as a Ray Serve application: :func:`build_serve_app`.

One deployment; each of its replicas (``num_replicas``, or as many as
``autoscaling_config`` asks: passed to Ray Serve as it is) is one engine
and the OpenAI routes over it, the app of ``asyncstep serve``
(:func:`asyncstep.server.build_app`, Starlette on AnyIO, run by Serve's
asyncio loop). Serve's proxy spreads the requests over the replicas; a
replica's ranks (TP x PP > 1) are Ray actors in bundles of the replica's
own placement group (:func:`~asyncstep.integrations.ray.open_ray_engine`),
so a replica is scheduled, scaled and stopped with its ranks.

Not Ray Serve LLM's ``LLMServer`` with a custom ``LLMEngine``: that
interface takes and returns vLLM's (or SGLang's) OpenAI protocol models,
so it needs vLLM or SGLang installed, and this engine has its own OpenAI
layer, which the app serves whole (streams, tools, reasoning, errors).

A replica (:class:`EngineReplica`) opens its engine in a task of its own on
the replica's event loop when it starts (Serve's late-bound app:
``__serve_build_asgi_app__``), and closes it when Serve stops
the replica (requests in flight were given Serve's graceful shutdown
first); Serve's health check fails once the engine has stopped, and Serve
then replaces the replica. The configs reach the replicas as msgspec JSON.

Imports ray (Serve) when :func:`build_serve_app` runs.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec

from asyncstep import Engine
from asyncstep.config import EngineConfig
from asyncstep.errors import ConfigError, EngineDeadError
from asyncstep.integrations.ray.placement import RayPlacement
from asyncstep.integrations.ray.ranks import open_ray_engine
from asyncstep.server import ServerConfig, build_app

#: The deployment's name unless given.
DEPLOYMENT_NAME = "asyncstep"


class EngineReplica:
    """One Serve replica: an engine, and the OpenAI app over it (Serve's
    ``__serve_build_asgi_app__``). Its arguments are msgspec JSON."""

    def __init__(self, engine_config: bytes, server_config: bytes, placement: bytes) -> None:
        self.config = msgspec.json.decode(engine_config, type=EngineConfig)
        self.server_config = msgspec.json.decode(server_config, type=ServerConfig)
        self.placement = msgspec.json.decode(placement, type=RayPlacement)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.engine: Engine | None = None

    async def _run(
        self, config: EngineConfig, placement: RayPlacement, opened: asyncio.Future[Engine]
    ) -> None:
        """The engine's life: open, serve until the replica stops, close."""
        try:
            async with open_ray_engine(config=config, placement=placement) as engine:
                opened.set_result(engine)
                await self._stop.wait()
        except BaseException as exc:
            if opened.done():
                raise
            opened.set_exception(exc)

    async def __serve_build_asgi_app__(self) -> Any:
        """Open the engine (in a task of its own, which outlives this call),
        then the app over it."""
        opened: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(self.config, self.placement, opened))
        self.engine = await opened
        return build_app(self.engine, self.server_config)

    async def check_health(self) -> None:
        """Serve's health check: the engine is still running."""
        if self.engine is None or self._task is None:
            return  # (still starting: Serve waits for the constructor)
        if self._task.done() or self.engine.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.engine.error}")

    def pids(self) -> dict[str, int | None]:
        """This replica's process id, and its engine core's (None: the core
        runs in the replica's process)."""
        core = getattr(self.engine, "core", None)
        return {"replica": os.getpid(), "core": getattr(core, "pid", None)}

    async def __del__(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


def _check_layout(config: EngineConfig) -> None:
    """A layout the model cannot take is refused here, once, rather than by
    every replica Serve starts (and starts again)."""
    from asyncstep.models.model_info import model_arch, validate_parallel_layout

    validate_parallel_layout(model_arch(config.model)[0], config.parallel)


def build_serve_app(
    model: str | Path | None = None,
    *,
    config: EngineConfig | None = None,
    server_config: ServerConfig | None = None,
    placement: RayPlacement | None = None,
    name: str = DEPLOYMENT_NAME,
    num_replicas: int | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    ray_actor_options: dict[str, Any] | None = None,
    **options: object,
) -> Any:
    """The Serve application (``serve.run(app)``; for ``serve run``, a
    builder of yours returns it): ``num_replicas`` replicas
    (default one) of an engine of ``model`` / ``options`` / ``config`` (as
    :func:`asyncstep.open_engine` takes them) under the OpenAI routes of
    ``server_config`` (its host, port and API server count are Serve's
    business and unused). ``autoscaling_config`` (Serve's, passed as it is)
    replaces ``num_replicas``; ``ray_actor_options`` (default one CPU) is
    each replica's own share, the first bundle of its placement group when
    its ranks are actors (``placement``, default :class:`RayPlacement`).
    A layout the model cannot take raises :class:`ConfigError` here."""
    from ray import serve

    if config is None:
        config = EngineConfig.from_options(model=model, **options)
    elif options or model is not None:
        raise ConfigError("pass either config or model/options to build_serve_app, not both")
    if num_replicas is not None and autoscaling_config is not None:
        raise ConfigError("give num_replicas or autoscaling_config, not both")
    _check_layout(config)
    placement = placement or RayPlacement()
    actor_options = dict(ray_actor_options or {"num_cpus": 1})
    deployment_options: dict[str, Any] = {"name": name, "ray_actor_options": actor_options}
    if autoscaling_config is not None:
        deployment_options["autoscaling_config"] = autoscaling_config
    else:
        deployment_options["num_replicas"] = num_replicas or 1
    if config.parallel.world_size > 1:
        own = {"CPU": float(actor_options.get("num_cpus", 1))}
        if actor_options.get("num_gpus"):
            own["GPU"] = float(actor_options["num_gpus"])
        deployment_options["placement_group_bundles"] = [own, *placement.bundles(config)]
        deployment_options["placement_group_strategy"] = placement.strategy
    deployment: Any = serve.deployment(serve.ingress()(EngineReplica), **deployment_options)
    return deployment.bind(
        msgspec.json.encode(config),
        msgspec.json.encode(server_config or ServerConfig()),
        msgspec.json.encode(placement),
    )
