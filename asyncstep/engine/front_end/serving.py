"""An engine's serving, on the caller's event loop: the engine core started
(its :class:`~asyncstep.engine.transport.core_client.CoreClient`), messages
queued for it, its messages handed to the engine's output thread
(:mod:`asyncstep.engine.front_end.output_thread`), and the end: closed, or
dead and why.

The loop hands the output thread each batch of the core's messages as it
arrives (undecoded, from a core in its own process) and gets back one call
per batch with the callers to wake. What the thread shares with the callers
is the :class:`~asyncstep.engine.front_end.output_processor.OutputProcessor`'s,
under its lock.

An engine serves the event loop it was opened on: :meth:`EngineServing.check_loop`
refuses a call from another loop or thread at once (it would hang, or
corrupt the engine's state).
"""

from __future__ import annotations

import contextlib
import math
import threading

import anyio
import anyio.lowlevel
import sniffio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.datatypes import WeightReads
from asyncstep.engine.front_end.output_processor import OutputProcessor
from asyncstep.engine.front_end.output_thread import OutputThread, call_soon
from asyncstep.engine.messages.core_messages import (
    CoreFailed,
    CoreReady,
    FromCore,
    Shutdown,
    ToCore,
)
from asyncstep.engine.transport.core_client import CoreClient
from asyncstep.errors import (
    EngineDeadError,
    EngineLoopError,
    describe,
    error_from_core,
    leaves,
    root_cause,
)
from asyncstep.logging import get_logger

log = get_logger("engine")


class EngineServing:
    """One engine's core and event loop (see the module doc)."""

    def __init__(self, core: CoreClient, outputs: OutputProcessor) -> None:
        #: The engine core's transport (an ``EngineCore`` itself in-process).
        self.core = core
        self.outputs = outputs
        #: Process ids of the rank processes (none when the rank runs in the core).
        self.rank_pids: list[int] = []
        #: The weight bytes a forward step reads, by its size (the floor of
        #: a memory-bound step; ``asyncstep bench``'s): the core's report.
        self.weight_reads: WeightReads | None = None
        #: The error that stopped the engine, if one did.
        self.error: BaseException | None = None
        #: The core's own report of why it stopped (its CoreFailed), once
        #: seen: it names the engine's error over the core's death that
        #: follows it (the transport may report the exit first).
        self._core_report: BaseException | None = None
        self._to_core: MemoryObjectSendStream[ToCore] | None = None
        #: aclose() was called: nothing more goes to the core.
        self._closing = False
        self._closed = False
        self._stopped = anyio.Event()
        #: The event loop it serves on (set by serve()), its thread, and where
        #: that is, in words.
        self._loop: anyio.lowlevel.EventLoopToken | None = None
        self._loop_thread: int | None = None
        self._loop_where = ""

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """``Engine.serve``: the core started, then its outputs handed to the
        requests until it stops."""
        self._loop = anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        self._loop_where = _where(self._loop)
        to_core_tx, to_core_rx = anyio.create_memory_object_stream[ToCore](math.inf)
        from_core_tx, from_core_rx = anyio.create_memory_object_stream[FromCore | bytes](math.inf)
        self._to_core = to_core_tx
        started = False
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.core.run, to_core_rx, from_core_tx)
                self._take_ready(await from_core_rx.receive())
                started = True
                task_status.started()
                await self._read_core(from_core_rx)
        except BaseException as exc:
            found = leaves(exc)
            cancelled = anyio.get_cancelled_exc_class()
            if any(not isinstance(e, Exception | cancelled) for e in found):
                # Ctrl-C (or SystemExit) reached a task: not an engine failure.
                self._die(EngineDeadError("the engine was interrupted"))
                raise
            errors = [e for e in found if isinstance(e, Exception)]
            if not errors:
                raise  # plain cancellation: the engine is being closed
            error = root_cause(exc)
            if not started:
                raise error from error.__cause__
            self._die(self._core_report or error)
        finally:
            self._closed = True
            to_core_tx.close()
            self.outputs.fail_all(self.error or EngineDeadError("the engine is closed"))
            self.deliver_wakeups()
            self._stopped.set()

    async def wait_stopped(self) -> None:
        """``Engine.wait_stopped``."""
        await self._stopped.wait()

    async def aclose(self, timeout_s: float = 10.0) -> bool:
        """``Engine.aclose``: the core told to shut down after the steps in
        flight; False if it took longer than ``timeout_s``."""
        self.check_loop()
        if self._to_core is not None and not (self._closing or self._closed):
            self._put_to_core(Shutdown())
            self._to_core.close()
        self._closing = True
        with anyio.move_on_after(timeout_s):
            await self._stopped.wait()
            return True
        return False

    def send(self, message: ToCore) -> None:
        """Queue a message for the core (unbounded: never waits); dropped
        once the engine is closing (the core then ends every request). From
        the output thread it is handed to the loop first."""
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            call_soon(self._loop, self.send, message)
            return
        if self._closing or self._closed or self._to_core is None:
            return
        self._put_to_core(message)

    def check_loop(self) -> None:
        """Raise :class:`EngineLoopError` unless called on the event loop the
        engine serves on (in that loop's thread)."""
        if self._loop is None or self._closed:
            return  # not serving (yet, or any more): its calls fail as such
        try:
            token: anyio.lowlevel.EventLoopToken | None = anyio.lowlevel.current_token()
        except anyio.NoEventLoopError:
            token = None
        if token is None or token.native_token is not self._loop.native_token:
            raise EngineLoopError(
                f"this engine serves {self._loop_where} and was called from "
                f"{_where(token)}: call it on its own loop (from another thread, through "
                "anyio.from_thread.run or a BlockingPortal), or use asyncstep.LLM, the "
                "blocking API"
            )

    def check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {describe(self.error)}") from self.error
        if self._closed or self._closing:
            raise EngineDeadError("the engine is closed")

    def deliver_wakeups(self) -> None:
        """Wake the waiters that news (or an end) reached: at once on the
        loop, else in one call handed to it."""
        wakeups = self.outputs.take_wakeups()
        if not wakeups:
            return
        if self._loop is None or threading.get_ident() == self._loop_thread:
            _set_all(wakeups)
        else:
            call_soon(self._loop, _set_all, wakeups)

    def _put_to_core(self, message: ToCore) -> None:
        """Queue ``message`` for the core; if the core's side has already
        gone (it died; :meth:`serve` is unwinding and reports why), drop it."""
        assert self._to_core is not None
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._to_core.send_nowait(message)

    async def _read_core(self, from_core: MemoryObjectReceiveStream[FromCore | bytes]) -> None:
        """Hand the core's messages to the output thread, each batch already
        queued at once, until the core stops; the thread's error is raised
        (also when the core failed meanwhile)."""
        assert self._loop is not None
        loop = self._loop
        with anyio.CancelScope() as scope:

            def failed(_: BaseException) -> None:  # on the thread: stop reading
                call_soon(loop, scope.cancel)

            thread = OutputThread[FromCore | bytes](self._take_messages, failed)
            thread.start()
            try:
                async with from_core:
                    try:
                        async for message in from_core:
                            thread.put([message, *_queued(from_core)])
                    finally:  # (cancelled: the core's run ended first)
                        self._keep_core_report(_queued(from_core))
            finally:
                thread.stop()
                with anyio.CancelScope(shield=True):
                    await thread.join()
                if thread.error is not None:
                    # Raised here, not after the scope: the core may have
                    # broken on the closed stream meanwhile (a consequence),
                    # and its group's cancellation would carry this away.
                    raise thread.error

    def _take_messages(self, messages: list[FromCore | bytes]) -> None:
        """Process a batch of the core's messages (on the output thread),
        then wake the callers whose news are in it; CoreFailed (after the
        messages before it) is raised."""
        failed = self.outputs.take_messages(messages)
        self.deliver_wakeups()
        if failed is not None:
            self._core_report = error_from_core(failed.error, failed.kind)
            raise self._core_report

    def _keep_core_report(self, unread: list[FromCore | bytes]) -> None:
        """The core's CoreFailed among messages left unread (the reading
        was cancelled: the core's transport ended first), kept as its
        report."""
        for item in unread:
            with contextlib.suppress(Exception):  # a bad frame: no report in it
                message = self.outputs.decode(item) if isinstance(item, bytes) else item
                if isinstance(message, CoreFailed):
                    self._core_report = error_from_core(message.error, message.kind)
                    return

    def _take_ready(self, item: FromCore | bytes) -> None:
        """The core's first message: CoreReady (the core sends it before it
        reports started)."""
        message = self.outputs.decode(item) if isinstance(item, bytes) else item
        if isinstance(message, CoreFailed):
            raise error_from_core(message.error, message.kind)
        if not isinstance(message, CoreReady):
            raise EngineDeadError(f"the engine core sent {type(message).__name__} first")
        self.outputs.core_stats = message.stats
        self.rank_pids = message.rank_pids
        self.weight_reads = message.weight_reads

    def _die(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            log.error("engine stopped", error=describe(error))


def _set_all(events: list[anyio.Event]) -> None:
    for event in events:
        event.set()


def _queued(
    stream: MemoryObjectReceiveStream[FromCore | bytes],
) -> list[FromCore | bytes]:
    """Every message already queued on ``stream``, without waiting."""
    queued: list[FromCore | bytes] = []
    with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):
        while True:
            queued.append(stream.receive_nowait())
    return queued


def _where(token: anyio.lowlevel.EventLoopToken | None) -> str:
    """The event loop of ``token`` (the current thread's), in words."""
    thread = threading.current_thread().name
    if token is None:
        return f"thread {thread!r}, which runs no event loop"
    return f"the {sniffio.current_async_library()} event loop of thread {thread!r}"
