"""``asyncstep serve``: the engine and the OpenAI-compatible app under
Hypercorn's Trio worker, in one ``trio.run``.

Start: ``host:port`` is bound (loopback unless told otherwise; an address
in use fails at once, before the model loads), the engine is opened, then
Hypercorn serves on that socket and ``ready(url, model_name)`` is called
(the CLI prints them: with port 0 the URL has the port the system chose).

Stop, on SIGTERM or SIGINT: ``notice`` is given one line saying what the
stop waits for and how to cut it short (the CLI prints it on stderr:
``asyncstep: stopping: waiting up to T s for N requests in flight; Ctrl-C
again to abort them``); new requests, ``/health`` included, are answered
503 (the listener still accepts) while requests in flight may finish for
``shutdown_timeout`` seconds; then what is left is aborted (its responses
end with finish reason ``abort``), Hypercorn stops accepting connections,
and once every response has been answered the engine is closed and
:func:`serve` returns. A second signal aborts at once. An engine that dies
stops the server the same way (without the line), and :func:`serve`
raises its :class:`~asyncstep.errors.EngineDeadError` (``asyncstep serve``
exits 1).

With ``api_server_count`` > 1 this process supervises that many API
server processes on the one socket and one engine core
(:mod:`asyncstep.server.api_servers`); each runs :func:`serve_app`.

With ``data_parallel_size`` > 1 the app serves a
:class:`~asyncstep.engine.front_end.data_parallel.DataParallelEngine`
(replicas behind one router): a replica's death fails its own requests and
the server goes on with the others; it stops once none is left. That takes
one API server (``api_server_count`` > 1 with it is refused at the door).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from asyncstep.config import EngineConfig
from asyncstep.engine.front_end.api import open_engine
from asyncstep.engine.front_end.data_parallel import open_data_parallel_engine
from asyncstep.errors import ConfigError
from asyncstep.logging import get_logger
from asyncstep.server.api_servers import serve_api_servers
from asyncstep.server.app_server import is_loopback, listen, serve_app
from asyncstep.server.config import ServerConfig

log = get_logger("server")


async def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    *,
    ready: Callable[[str, str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    log_level: str = "warning",
    notice: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT (see the module's docstring)."""
    check_layout(engine_config, server_config)
    if not is_loopback(server_config.host):
        log.warning(
            "listening off loopback: other machines can reach the API",
            host=server_config.host,
            api_key="set" if server_config.api_key else "none",
        )
    # Bound first: an address in use fails before the model loads.
    listener = listen(server_config.host, server_config.port)
    with listener:
        await _serve(engine_config, server_config, listener, ready, progress, log_level, notice)


async def _serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    listener: socket.socket,
    ready: Callable[[str, str], None] | None,
    progress: Callable[[int, int], None] | None,
    log_level: str,
    notice: Callable[[str], None] | None,
) -> None:
    if server_config.api_server_count > 1:
        await serve_api_servers(
            engine_config, server_config, listener, ready, progress, log_level, notice
        )
        return
    parallel = engine_config.parallel
    if parallel.data_parallel_size > 1 and parallel.data_parallel_rank is None:
        async with open_data_parallel_engine(engine_config, progress) as replicas:
            await serve_app(replicas, server_config, listener, ready, log_level, notice)
        return
    async with open_engine(config=engine_config, progress=progress) as engine:
        await serve_app(engine, server_config, listener, ready, log_level, notice)


def check_layout(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """The engine's and the server's processes fit together (ConfigError)."""
    parallel = engine_config.parallel
    replicas_here = parallel.data_parallel_size > 1 and parallel.data_parallel_rank is None
    if replicas_here and server_config.api_server_count > 1:
        raise ConfigError(
            "data_parallel_size > 1 is served by one API server "
            "(api_server_count must be 1 with it)"
        )
