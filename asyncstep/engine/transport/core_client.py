"""The process boundary: :class:`CoreProcess` runs the engine core in a child
process (``python -m asyncstep.engine.transport.core_process``) and carries the front
end's messages to it and its messages back, msgpack-framed, over a socket
pair whose other end the child inherits as a file descriptor. Nothing
listens: a socket pair has no address another process could connect to, so
unlike the ranks' control connections it needs no secret and no handshake.

:class:`CoreConnection` is an attached front end's side (an API server of
``asyncstep serve --api-server-count``): a core another process started,
over a socket it inherited; the core's end of the connection, or its
:class:`CoreFailed`, ends it with :class:`EngineCoreDied`.

:class:`CoreClient` is the ``run`` contract the front end holds them to.
In-process, the front end drives an :class:`~asyncstep.engine.core.engine_core.EngineCore`
directly (it has the same ``run`` contract), over memory channels.

Messages from the core go to the front end as they are read, undecoded (the
front end decodes them off its event loop), without a wait of the loop in
between: a batch of frames that arrived together reaches it at once.
Messages to the core are coalesced: every :class:`CoreInputs` queued while
the previous frame was written goes out as one. The child is started with
its stdin a pipe from this process, to die with it; its unexpected exit, or
the end of its connection, ends :meth:`CoreProcess.run` with :class:`EngineCoreDied` within
a second or two. On the way out the child is given ``exit_timeout_s`` to
finish, then terminated, then killed: none is left behind.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import anyio
import anyio.abc
from anyio.abc import Process, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.channels.framing import MessageStream
from asyncstep.config import EngineConfig
from asyncstep.engine.messages.core_messages import (
    CoreFailed,
    CoreInputs,
    CoreReady,
    CoreSetup,
    CoreStart,
    FromCore,
    LoadProgress,
    Shutdown,
    ToCore,
)
from asyncstep.errors import EngineDeadError, error_from_core
from asyncstep.logging import get_logger
from asyncstep.logging.spans import STARTUP, span
from asyncstep.procs import exit_reason

if TYPE_CHECKING:
    from asyncstep.models.model_loader import ProgressFn

log = get_logger("engine")
R = TypeVar("R")


class CoreClient(Protocol):
    """Runs an engine core for the front end (in this process or another):
    started once the core is ready (:class:`CoreReady` sent to ``from_core``
    first); then carries ``to_core`` to it and its messages to ``from_core``
    until ``to_core`` ends and the core has stopped. Raises if the core
    fails or dies. A message on ``from_core`` is decoded, or the msgpack
    frame of one as it came over a connection (the front end decodes it,
    off its event loop)."""

    async def run(
        self,
        to_core: MemoryObjectReceiveStream[ToCore],
        from_core: MemoryObjectSendStream[FromCore | bytes],
        *,
        task_status: TaskStatus[None] = ...,
    ) -> None: ...


class EngineCoreDied(EngineDeadError):
    """The engine-core process exited, or its connection broke, unasked."""


@dataclass
class CoreProcess:
    """The engine core in a child process (see the module doc)."""

    config: EngineConfig
    eos_token_ids: frozenset[int]
    progress: ProgressFn | None = None
    log_level: str = "warning"
    #: The child logs JSON lines (step-timeline spans too) to this file.
    log_json: str | None = None
    #: Seconds the child gets to exit after Shutdown before it is terminated.
    exit_timeout_s: float = 10.0
    #: The core's ends of the connections of attached front ends (the child
    #: inherits them; they are closed here once it started).
    attach: Sequence[socket.socket] = ()
    process: Process | None = field(default=None, init=False)
    _stopping: bool = field(default=False, init=False)
    #: A child started by :meth:`spawn_early` that :meth:`run` has not taken yet.
    _early: tuple[Process, MessageStream[FromCore]] | None = field(default=None, init=False)
    #: Set when the reader reaches the connection's end (made by :meth:`run`).
    _connection_ended: anyio.Event | None = field(default=None, init=False)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def run(
        self,
        to_core: MemoryObjectReceiveStream[ToCore],
        from_core: MemoryObjectSendStream[FromCore | bytes],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        if self._early is None:
            await self.spawn_early()
        assert self._early is not None
        self.process, channel = self._early
        self._early = None
        self._connection_ended = anyio.Event()
        try:
            async with anyio.create_task_group() as tg, from_core:
                tg.start_soon(self._watch, self.process)
                await channel.send(CoreStart(sorted(self.eos_token_ids)))
                with span("core_ready_wait", STARTUP):
                    ready = await self._wait_ready(channel)
                await from_core.send(ready)
                task_status.started()
                tg.start_soon(_send_inputs, to_core, channel, self._expect_stop)
                await self._forward_from_core(channel, from_core)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop(channel)

    async def spawn_early(self) -> None:
        """Start the child and send it ``config`` before :meth:`run`: it
        imports its modules and loads the model while the caller finishes
        its own set-up (the tokenizer); :meth:`run` then sends
        ``eos_token_ids``. A child that ``run`` never takes is killed by
        :meth:`discard`."""
        ours, theirs = socket.socketpair()
        try:
            process = await self._spawn(theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            for sock in self.attach:
                sock.close()
        channel = MessageStream[FromCore](await anyio.abc.SocketStream.from_socket(ours), FromCore)
        self._early = (process, channel)
        await channel.send(CoreSetup(self.config))

    async def discard(self) -> None:
        """Kill a child :meth:`spawn_early` started that :meth:`run` did not take."""
        if self._early is None:
            return
        process, channel = self._early
        self._early = None
        with anyio.CancelScope(shield=True):
            await channel.aclose()
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.aclose()

    async def _spawn(self, fd: int) -> Process:
        command = [
            sys.executable,
            "-m",
            "asyncstep.engine.transport.core_process",
            "--fd",
            str(fd),
            "--log-level",
            self.log_level,
        ]
        attach_fds = tuple(sock.fileno() for sock in self.attach)
        for attached in attach_fds:
            command += ["--attach-fd", str(attached)]
        if self.log_json is not None:
            command += ["--log-json", self.log_json]
        process = await anyio.open_process(
            command,
            stdin=subprocess.PIPE,  # never written: its end tells the child we died
            stdout=None,
            stderr=None,
            pass_fds=(fd, *attach_fds),
        )
        log.info("engine core started", pid=process.pid)
        return process

    async def _wait_ready(self, channel: MessageStream[FromCore]) -> CoreReady:
        while True:
            message = await self._receive(channel.receive())
            if isinstance(message, CoreReady):
                return message
            if isinstance(message, LoadProgress):
                if self.progress is not None:
                    self.progress(message.done, message.total)
            elif isinstance(message, CoreFailed):
                raise error_from_core(message.error, message.kind)
            else:
                raise EngineCoreDied(f"the engine core sent {type(message).__name__} first")

    def _expect_stop(self, expected: bool) -> None:
        self._stopping = expected

    async def _forward_from_core(
        self,
        channel: MessageStream[FromCore],
        from_core: MemoryObjectSendStream[FromCore | bytes],
    ) -> None:
        """The core's frames, undecoded, to the front end."""
        while True:
            try:
                frame = await self._receive(channel.receive_frame())
            except EngineCoreDied:
                if self._stopping:
                    return
                raise
            await _forward(from_core, frame)

    async def _receive(self, receiving: Awaitable[R]) -> R:
        """A message, or a frame, from the core; :class:`EngineCoreDied` if it is gone."""
        try:
            return await receiving
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
            if self._connection_ended is not None:
                self._connection_ended.set()
            raise EngineCoreDied(await self._death_notice()) from None

    async def _watch(self, process: Process) -> None:
        code = await process.wait()
        if not self._stopping:
            # Its last frames first (a CoreFailed names why it stopped): the
            # reader ends the run at the connection's end; else this, soon.
            if self._connection_ended is not None:
                with anyio.move_on_after(1):
                    await self._connection_ended.wait()
            raise EngineCoreDied(f"the engine core process {exit_reason(code)}")

    async def _death_notice(self) -> str:
        if self.process is not None:
            with anyio.move_on_after(2):
                return f"the engine core process {exit_reason(await self.process.wait())}"
        return "the engine core closed its connection"

    async def _stop(self, channel: MessageStream[FromCore]) -> None:
        """Let the child finish (it sees Shutdown or the end of the
        connection), then terminate, then kill it."""
        self._stopping = True
        with contextlib.suppress(Exception):
            await channel.aclose()
        process = self.process
        if process is None or process.returncode is not None:
            return
        with anyio.move_on_after(self.exit_timeout_s):
            await process.wait()
            return
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
            with anyio.move_on_after(wait_s if wait_s is not None else 30):
                await process.wait()
                return


@dataclass
class CoreConnection:
    """An engine core started by another process, over the inherited
    socket ``fd`` (see the module doc)."""

    fd: int
    _stopping: bool = field(default=False, init=False)

    def _expect_stop(self, expected: bool) -> None:
        self._stopping = expected

    async def run(
        self,
        to_core: MemoryObjectReceiveStream[ToCore],
        from_core: MemoryObjectSendStream[FromCore | bytes],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        stream = await anyio.abc.SocketStream.from_socket(socket.socket(fileno=self.fd))
        channel = MessageStream[FromCore](stream, FromCore)

        async def receive() -> FromCore:
            message = await receive_frame(channel.receive())
            if isinstance(message, CoreFailed):
                raise error_from_core(message.error, message.kind)
            return message

        async def receive_frame(receiving: Awaitable[R]) -> R:
            try:
                return await receiving
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                raise EngineCoreDied("the engine core closed its connection") from None

        try:
            async with anyio.create_task_group() as tg, from_core:
                while not isinstance(ready := await receive(), CoreReady):
                    pass  # LoadProgress is the primary's
                await from_core.send(ready)
                task_status.started()
                tg.start_soon(_send_inputs, to_core, channel, self._expect_stop)
                while True:  # the core's frames, undecoded (a CoreFailed too)
                    try:
                        frame = await receive_frame(channel.receive_frame())
                    except EngineCoreDied:
                        if self._stopping:
                            break
                        raise
                    await _forward(from_core, frame)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await channel.aclose()


async def _forward(
    from_core: MemoryObjectSendStream[FromCore | bytes], message: FromCore | bytes
) -> None:
    """``message`` to the front end; without a wait while ``from_core`` has
    room (the front end's is unbounded): the frames already received go on
    at once, the reader's next wait is for the socket."""
    try:
        from_core.send_nowait(message)
    except anyio.WouldBlock:
        await from_core.send(message)


async def _send_inputs(
    to_core: MemoryObjectReceiveStream[ToCore],
    channel: MessageStream[FromCore],
    expect_stop: Callable[[bool], None],
) -> None:
    """The front end's messages -> the core, runs of CoreInputs coalesced;
    ``expect_stop(True)`` as Shutdown is sent or once the front end is done
    (the core then ends on EOF). A connection broken under a send ends this
    quietly (``expect_stop(False)``): the receiving side then says how the
    core died."""
    async with to_core:
        async for first in to_core:
            for message in _coalesced([first, *_queued(to_core)]):
                if isinstance(message, Shutdown):
                    expect_stop(True)  # before the send: the core may answer with EOF at once
                try:
                    await channel.send(message)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    expect_stop(False)
                    return
    expect_stop(True)


def _queued(stream: MemoryObjectReceiveStream[ToCore]) -> list[ToCore]:
    """Every message already queued on ``stream``, without waiting."""
    queued: list[ToCore] = []
    with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):
        while True:
            queued.append(stream.receive_nowait())
    return queued


def _coalesced(messages: list[ToCore]) -> list[ToCore]:
    """Runs of :class:`CoreInputs` merged into one (order kept)."""
    out: list[ToCore] = []
    for message in messages:
        last = out[-1] if out else None
        # The core adds before it aborts: a request added after an abort of
        # the same id (an id reused at once) must not be merged before it.
        if (
            isinstance(message, CoreInputs)
            and isinstance(last, CoreInputs)
            and not (message.new_requests and (last.aborted or last.stopped))
        ):
            out[-1] = CoreInputs(
                last.new_requests + message.new_requests,
                last.aborted + message.aborted,
                last.stopped + message.stopped,
            )
        else:
            out.append(message)
    return out
