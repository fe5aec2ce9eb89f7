"""``asyncstep serve``: the engine and the OpenAI-compatible app under
Hypercorn's Trio worker, in one ``trio.run``.

Start: the engine is opened (the model loaded), then Hypercorn binds
``host:port`` (loopback unless told otherwise) and ``ready(url)`` is
called (the CLI prints the URL: with port 0 it is the port the system
chose).

Stop, on SIGTERM or SIGINT: Hypercorn stops accepting connections and
``/health`` answers 503; requests in flight may finish for
``shutdown_timeout`` seconds, then are aborted (their responses end with
finish reason ``abort``); once they have been answered the engine is
closed and :func:`serve` returns. A second signal aborts at once.
"""

from __future__ import annotations

import ipaddress
import signal
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig

from asyncstep.config import EngineConfig
from asyncstep.engine.api import open_engine
from asyncstep.logging import get_logger
from asyncstep.server.app import OpenAIServer
from asyncstep.server.config import ServerConfig

log = get_logger("server")

#: Extra seconds Hypercorn gives connections after the requests were
#: aborted, for their last bytes.
FLUSH_GRACE_S = 5.0


def hypercorn_config(config: ServerConfig, log_level: str = "warning") -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [config.bind]
    hc.graceful_timeout = config.shutdown_timeout + FLUSH_GRACE_S
    hc.keep_alive_timeout = config.keep_alive_timeout
    hc.accesslog = "-" if config.access_log else None  # "-": stderr
    hc.loglevel = log_level.upper()
    hc.include_server_header = False
    return hc


async def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    *,
    ready: Callable[[str], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    log_level: str = "warning",
) -> None:
    """Serve until SIGTERM or SIGINT (see the module's docstring)."""
    if not _is_loopback(server_config.host):
        log.warning(
            "listening off loopback: other machines can reach the API",
            host=server_config.host,
            api_key="set" if server_config.api_key else "none",
        )
    async with open_engine(config=engine_config, progress=progress) as engine:
        server = OpenAIServer(engine, server_config)
        stop = trio.Event()
        async with trio.open_nursery() as outer:
            outer.start_soon(_watch_signals, server, stop)
            async with trio.open_nursery() as http:

                async def shutdown_trigger() -> None:
                    await stop.wait()
                    log.info("stopping", in_flight=len(server.in_flight))
                    http.start_soon(server.drain, server_config.shutdown_timeout)

                hc = hypercorn_config(server_config, log_level)
                binds = await http.start(
                    partial(
                        hypercorn.trio.serve,
                        cast(Any, server.app),  # Starlette's ASGI types are not Hypercorn's
                        hc,
                        shutdown_trigger=shutdown_trigger,
                    )
                )
                if ready is not None:
                    ready(binds[0] if binds else f"http://{server_config.bind}")
            # Hypercorn has answered every connection (or given up on them).
            outer.cancel_scope.cancel()
        log.info("stopped")


async def _watch_signals(server: OpenAIServer, stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if stop.is_set():
                log.warning("second signal: aborting every request", signal=signum)
                server.abort_all()
            stop.set()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere
