"""One API server: the OpenAI app over an engine under Hypercorn's Trio
worker, on a listening socket, until SIGTERM or SIGINT or the engine's death
(the stop is :mod:`asyncstep.server.serve`'s docstring); and the listening
socket itself. Used by ``asyncstep serve`` in its own process and by each
API server process of :mod:`asyncstep.server.api_servers`.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig

from asyncstep.engine.front_end.data_parallel import ServedEngine
from asyncstep.errors import ConfigError
from asyncstep.logging import get_logger
from asyncstep.server.app import OpenAIServer
from asyncstep.server.config import ServerConfig

log = get_logger("server")

#: Seconds Hypercorn gives connections once the drain is over (every
#: request answered, or aborted), for their last bytes.
FLUSH_GRACE_S = 5.0


def hypercorn_config(
    config: ServerConfig, listener: socket.socket, log_level: str = "warning"
) -> HypercornConfig:
    """Hypercorn's config, serving on ``listener`` (which it then owns)."""
    hc = HypercornConfig()
    hc.bind = [f"fd://{listener.detach()}"]
    hc.graceful_timeout = FLUSH_GRACE_S  # after the drain (see serve_app)
    hc.keep_alive_timeout = config.keep_alive_timeout
    hc.accesslog = "-" if config.access_log else None  # "-": stderr
    hc.loglevel = log_level.upper()
    hc.include_server_header = False
    return hc


async def serve_app(
    engine: ServedEngine,
    server_config: ServerConfig,
    listener: socket.socket,
    ready: Callable[[str, str], None] | None,
    log_level: str,
    notice: Callable[[str], None] | None = None,
) -> None:
    """The app over ``engine`` under Hypercorn on ``listener``, until
    SIGTERM or SIGINT, or the engine's death (see the module's docstring).
    ``notice`` is given the first signal's line (:func:`stop_notice`).

    The drain runs before Hypercorn is told to stop: the listener keeps
    accepting meanwhile, so that a new ``/health`` or generation request is
    answered 503, not refused a connection."""
    server = OpenAIServer(engine, server_config)
    stop = trio.Event()
    async with trio.open_nursery() as outer:
        outer.start_soon(_watch_signals, server, stop, notice)
        outer.start_soon(_watch_engine, server, stop)
        async with trio.open_nursery() as http:

            async def shutdown_trigger() -> None:
                await stop.wait()
                log.info("stopping", in_flight=len(server.in_flight))
                await server.drain(server_config.shutdown_timeout)

            hc = hypercorn_config(server_config, listener, log_level)
            binds = await http.start(
                partial(
                    hypercorn.trio.serve,
                    cast(Any, server.app),  # Starlette's ASGI types are not Hypercorn's
                    hc,
                    shutdown_trigger=shutdown_trigger,
                )
            )
            if ready is not None:
                ready(binds[0] if binds else f"http://{server_config.bind}", server.model_name)
        # Hypercorn has answered every connection (or given up on them).
        outer.cancel_scope.cancel()
    log.info("stopped")


async def _watch_signals(
    server: OpenAIServer, stop: trio.Event, notice: Callable[[str], None] | None
) -> None:
    # The receiver restores this when the app has stopped: a SIGTERM then (an
    # API server's supervisor passing on a second signal while this process
    # closes its engine) has nothing left to abort, and must not kill it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if stop.is_set():
                log.warning("second signal: aborting every request", signal=signum)
                server.abort_all()
            elif notice is not None:
                timeout_s = server.config.shutdown_timeout
                notice(stop_notice(signum, timeout_s, len(server.in_flight)))
            stop.set()


def stop_notice(signum: int, timeout_s: float, in_flight: int | None) -> str:
    """The first signal's line: what the stop waits for, and how to cut it
    short (``in_flight`` None: the API servers' requests, not counted here)."""
    if in_flight == 0:
        return "stopping: no requests in flight"
    if in_flight is None:
        requests = "the requests in flight"
    else:
        requests = f"{in_flight} request{'' if in_flight == 1 else 's'} in flight"
    again = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    return f"stopping: waiting up to {timeout_s:g} s for {requests}; {again} again to abort them"


async def _watch_engine(server: OpenAIServer, stop: trio.Event) -> None:
    """An engine that dies stops the server (a supervisor can then restart
    it): leaving ``open_engine`` raises the engine's error."""
    engine = server.engine
    await engine.wait_stopped()
    if engine.error is not None:
        log.error("the engine died: stopping the server", error=str(engine.error))
        stop.set()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (an IPv6 address or name too)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (a name other than localhost: no)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere
