"""The front end's output thread: the engine core's messages processed off
the caller's event loop (vLLM v1's output processing: outputs decoded, the
requests' states updated, detokenization, stop strings, log-probs).

The caller's loop hands :class:`OutputThread` each batch of the core's
messages as it arrives (one non-blocking put) and gets back, through
:func:`call_soon`, one call per batch with the callers to wake. The thread
runs the engine's ``process`` on the batches in order, one at a time; what
``process`` shares with the callers is the engine's to guard (its lock).
An error of ``process`` ends the thread: ``failed`` is called with it (on
the thread) and it stays in :attr:`OutputThread.error`.

Nothing here waits on either side but :meth:`OutputThread.join`.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

import anyio
import anyio.lowlevel
import anyio.to_thread
import sniffio
import trio

T = TypeVar("T")


def call_soon(
    loop: anyio.lowlevel.EventLoopToken, fn: Callable[..., object], *args: object
) -> bool:
    """Run ``fn(*args)`` on ``loop`` soon, from any thread, without waiting
    (calls from one thread run in their order); False if the loop has ended.
    Through the loops' own public calls (Trio's token, asyncio's
    ``call_soon_threadsafe``): anyio's backend classes have no stable one
    across its 4.x releases."""
    token = loop.native_token
    try:
        if isinstance(token, asyncio.AbstractEventLoop):
            context = contextvars.copy_context()
            context.run(sniffio.current_async_library_cvar.set, "asyncio")
            token.call_soon_threadsafe(context.run, fn, *args)
        else:
            cast(trio.lowlevel.TrioToken, token).run_sync_soon(fn, *args)
    except trio.RunFinishedError:
        return False
    except RuntimeError:  # asyncio's, once the loop has closed
        if isinstance(token, asyncio.AbstractEventLoop) and token.is_closed():
            return False
        raise
    return True


class OutputThread(Generic[T]):
    """A thread that runs ``process`` on each batch put, in order (see the module doc)."""

    def __init__(
        self,
        process: Callable[[list[T]], None],
        failed: Callable[[BaseException], None],
        *,
        name: str = "asyncstep-outputs",
    ) -> None:
        self._process = process
        self._failed = failed
        self._batches: queue.SimpleQueue[list[T] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        #: The error that ended the thread (read it after :meth:`join`).
        self.error: BaseException | None = None

    @property
    def name(self) -> str:
        return self._thread.name

    def start(self) -> None:
        self._thread.start()

    def put(self, batch: list[T]) -> None:
        """Queue a batch (from any thread; never waits)."""
        self._batches.put(batch)

    def stop(self) -> None:
        """The thread ends once the batches queued before this are processed."""
        self._batches.put(None)

    async def join(self) -> None:
        """Wait until the thread has ended (after :meth:`stop`, or an error)."""
        if self._thread.ident is not None:
            await anyio.to_thread.run_sync(self._thread.join)

    def _run(self) -> None:
        while (batch := self._batches.get()) is not None:
            try:
                self._process(batch)
            except BaseException as exc:  # whatever it is: the loop must hear of it
                self.error = exc
                self._failed(exc)
                return
