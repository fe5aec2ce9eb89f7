"""``asyncstep serve --api-server-count N`` (N > 1): N API server processes
on one listening socket and one engine core, as vLLM's API server scale-out.

A streamed token costs the HTTP layer and the detokenizer some tens of
microseconds of one process's GIL; N front-end processes share that work
(the kernel hands each new connection to whichever accepts first, so an idle
one takes it).

The supervisor (the ``asyncstep serve`` process, :func:`serve_api_servers`)
binds the socket, opens the engine with :func:`open_shared_engine` (its
core process also serves one socket pair per API server), then starts the
API servers (``python -m asyncstep.server.api_servers``): each inherits the
socket and its end of its pair, reads its :class:`ApiServerSetup` from its
stdin (kept open, never written again: its end tells the API server that the
supervisor died), opens :func:`attach_engine` and serves the app
(:func:`~asyncstep.server.app_server.serve_app`), then prints one JSON line
``{"url": ..., "model": ...}`` on its stdout. ``ready`` is called once every
API server has. Prometheus counters are shared through
``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory, removed at the end), so
``/metrics`` of any API server counts them all.

Stop: SIGTERM or SIGINT is passed on to every API server as SIGTERM (a
second: again, and they abort their requests at once); each stops as one
server does, and the first signal's line is the supervisor's (one, not one
per API server). Once all have exited, the core is shut down. An API server
that exits unasked (its engine died, it crashed) stops the others, and
:func:`serve_api_servers` raises :class:`EngineDeadError` (exit 1).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence

import anyio
import msgspec
import trio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from asyncstep.config import EngineConfig
from asyncstep.engine.front_end.api import attach_engine, open_shared_engine
from asyncstep.errors import EngineDeadError, exit_status
from asyncstep.logging import configure_logging, get_logger, json_log_file
from asyncstep.procs import exit_reason, exit_when_parent_dies
from asyncstep.server.app_server import serve_app, stop_notice
from asyncstep.server.config import ServerConfig
from asyncstep.server.metrics import MULTIPROCESS_DIR_ENV

log = get_logger("server")

#: Seconds an API server lives on once its supervisor died.
EXIT_GRACE_S = 5.0
_LENGTH = struct.Struct("!I")
_MAX_SETUP_BYTES = 1 << 20
_MAX_READY_LINE = 64 << 10


class ApiServerSetup(msgspec.Struct, frozen=True):
    """What an API server is given on its stdin."""

    engine_config: EngineConfig
    server_config: ServerConfig
    #: 1..N: tells its generated request ids apart.
    index: int
    listen_fd: int
    core_fd: int
    log_level: str
    log_json: str | None = None


class Ready(msgspec.Struct, frozen=True):
    """An API server's one line on its stdout once it serves."""

    url: str
    model: str


async def serve_api_servers(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    listener: socket.socket,
    ready: Callable[[str, str], None] | None,
    progress: Callable[[int, int], None] | None,
    log_level: str,
    notice: Callable[[str], None] | None = None,
) -> None:
    """Supervise ``server_config.api_server_count`` API servers on
    ``listener`` (see the module doc) until they have all stopped;
    ``notice`` is given the first signal's line."""
    count = server_config.api_server_count
    pairs = [socket.socketpair() for _ in range(count)]
    metrics_dir = tempfile.mkdtemp(prefix="asyncstep-metrics-")
    log_json = json_log_file()
    servers: list[Process] = []

    def first_signal(signum: int) -> None:
        if notice is not None:
            notice(stop_notice(signum, server_config.shutdown_timeout, None))

    async def start_servers() -> None:
        """Each API server, as soon as the core's process is: it loads its
        tokenizer while the core loads the model, then waits for it."""
        for index, (ours, _) in enumerate(pairs, start=1):
            setup = ApiServerSetup(
                engine_config,
                server_config,
                index,
                listener.fileno(),
                ours.fileno(),
                log_level,
                None if log_json is None else f"{log_json}.api{index}",
            )
            servers.append(await _start(setup, metrics_dir))
            ours.close()
        listener.close()  # the API servers hold it: it closes when they stop listening

    try:
        cores = [core for _, core in pairs]
        async with open_shared_engine(
            engine_config, cores, progress, core_started=start_servers
        ) as engine:
            failures = await _supervise(servers, engine.wait_stopped, ready, first_signal)
            if failures and engine.error is None:  # (an engine error is raised on leaving)
                raise EngineDeadError("; ".join(failures))
    finally:
        with anyio.CancelScope(shield=True):
            await _end(servers)
        for ours, core in pairs:
            ours.close()
            core.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _end(servers: list[Process]) -> None:
    """Terminate the API servers still running (those of an engine that
    failed to open: supervised ones have stopped), then reap them."""
    for process in servers:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
    for process in servers:
        with anyio.move_on_after(10):
            await process.wait()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


async def _start(setup: ApiServerSetup, metrics_dir: str) -> Process:
    process = await anyio.open_process(
        [sys.executable, "-m", "asyncstep.server.api_servers"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None,
        pass_fds=(setup.listen_fd, setup.core_fd),
        start_new_session=True,  # Ctrl-C reaches the supervisor, which passes it on once
        env={**os.environ, MULTIPROCESS_DIR_ENV: metrics_dir},
    )
    assert process.stdin is not None
    payload = msgspec.msgpack.encode(setup)
    await process.stdin.send(_LENGTH.pack(len(payload)) + payload)
    log.info("API server started", index=setup.index, pid=process.pid)
    return process


async def _supervise(
    servers: Sequence[Process],
    engine_stopped: Callable[[], Awaitable[None]],
    ready: Callable[[str, str], None] | None,
    first_signal: Callable[[int], None],
) -> list[str]:
    """Run until every API server has exited; what went wrong, if anything
    (``first_signal`` is called with the first SIGTERM or SIGINT)."""
    stopping = False
    failures: list[str] = []
    announced: list[Ready] = []

    def stop_all() -> None:
        nonlocal stopping
        stopping = True
        for process in servers:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)

    async def watch(index: int, process: Process) -> None:
        assert process.stdout is not None
        with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
            line = await BufferedByteReceiveStream(process.stdout).receive_until(
                b"\n", _MAX_READY_LINE
            )
            announced.append(msgspec.json.decode(line, type=Ready))
            if len(announced) == len(servers) and ready is not None:
                ready(announced[0].url, announced[0].model)
        code = await process.wait()
        if code != 0 or not stopping:
            failures.append(f"API server {index} {exit_reason(code)}")
            stop_all()

    async def watch_signals() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("stopping the API servers", signal=signum)
                if not stopping:
                    first_signal(signum)
                stop_all()

    async def watch_engine() -> None:
        await engine_stopped()
        stop_all()

    async with trio.open_nursery() as outer:
        outer.start_soon(watch_signals)
        outer.start_soon(watch_engine)
        async with trio.open_nursery() as nursery:
            for index, process in enumerate(servers, start=1):
                nursery.start_soon(watch, index, process)
        outer.cancel_scope.cancel()
    for process in servers:
        if process.stdin is not None:
            await process.stdin.aclose()
    return failures


# -- an API server -------------------------------------------------------------


async def run_api_server(setup: ApiServerSetup) -> None:
    """Serve the app on the inherited socket, over the shared engine core."""

    def announce(url: str, model: str) -> None:
        sys.stdout.buffer.write(msgspec.json.encode(Ready(url, model)) + b"\n")
        sys.stdout.flush()

    listener = socket.socket(fileno=setup.listen_fd)
    async with attach_engine(setup.engine_config, setup.core_fd, setup.index) as engine:
        await serve_app(engine, setup.server_config, listener, announce, setup.log_level)


def read_setup(stream: int = 0) -> ApiServerSetup:
    """The setup frame on ``stream`` (a length, then msgpack)."""
    (size,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))
    if size > _MAX_SETUP_BYTES:
        raise ValueError(f"setup of {size} bytes is larger than {_MAX_SETUP_BYTES}")
    return msgspec.msgpack.decode(_read_exactly(stream, size), type=ApiServerSetup)


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the supervisor closed the setup pipe")
        data += chunk
    return data


def main() -> int:
    setup = read_setup()
    exit_when_parent_dies(EXIT_GRACE_S)
    configure_logging(setup.log_level, setup.log_json)
    try:
        trio.run(run_api_server, setup)
    except BaseException as exc:
        return exit_status(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
