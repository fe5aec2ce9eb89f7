"""The engine core's side of its front ends: one connection from the
*primary* front end (it sent :class:`CoreSetup`; its Shutdown or its going
away stops the core), and any number *attached* (the API servers of
``asyncstep serve --api-server-count N``, each an ``Engine`` of its own).

:class:`FrontEnds` merges what they send into the core's one input stream
and splits the core's events between them:

* a request belongs to the front end that added it; an id already in
  flight from another front end is refused to the newcomer
  (:class:`RejectedRequest`), and a front end can abort or stop only its
  own requests;
* each step's :class:`CoreOutputs` goes to each front end with news in it
  (its own requests' outputs or refusals), and to the others at most every
  :data:`STATS_INTERVAL_S` (so each sees the queue); :class:`CoreReady`
  and :class:`CoreFailed` go to all, :class:`LoadProgress` to the
  primary, :class:`Idle` to the one that asked (tickets are renumbered
  across front ends);
* an attached front end that says Shutdown or goes away has its requests
  aborted; the core keeps serving the others.

With no attached front end, messages pass unchanged. Each front end has
its own unbounded outbox: a slow reader never holds up the core or the
others. Imports only the messages and the framing.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Sequence

import anyio
import anyio.abc
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.channels.framing import MessageStream
from asyncstep.engine.messages.core_messages import (
    CoreInputs,
    CoreOutputs,
    CoreReady,
    CoreStats,
    EngineCoreOutput,
    EngineCoreRequest,
    FromCore,
    Idle,
    LoadProgress,
    RejectedRequest,
    Shutdown,
    ToCore,
    WaitIdle,
)
from asyncstep.logging import get_logger

log = get_logger("engine")

PRIMARY = 0
#: A front end with no news in a step is sent its stats at most this often
#: (every message costs the core's loop, which the next step waits for).
STATS_INTERVAL_S = 0.05

#: What a reader sees when its front end closed the connection.
PEER_LEFT = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError)
#: ... or a writer; or either once the connection was closed on this side.
PEER_GONE = (*PEER_LEFT, anyio.ClosedResourceError)


class FrontEnds:
    """The core's connections to its front ends (see the module doc);
    ``channels[0]`` is the primary's."""

    def __init__(self, channels: Sequence[MessageStream[ToCore]]) -> None:
        if not channels:
            raise ValueError("an engine core needs its primary front end")
        self.channels = list(channels)
        #: Request id -> the front end that added it (attached front ends only).
        self._owner: dict[str, int] = {}
        #: The core's Idle ticket -> (front end, its own ticket).
        self._tickets: dict[int, tuple[int, int]] = {}
        self._next_ticket = itertools.count()
        #: Attached front ends that left (what is routed to them is dropped).
        self._gone: set[int] = set()
        self._stats = CoreStats()
        #: When each front end is next sent a step without news of its own.
        self._stats_due = [0.0] * len(self.channels)
        boxes = [anyio.create_memory_object_stream[FromCore](math.inf) for _ in self.channels]
        self._outboxes: list[MemoryObjectSendStream[FromCore]] = [tx for tx, _ in boxes]
        self._inboxes: list[MemoryObjectReceiveStream[FromCore]] = [rx for _, rx in boxes]

    @property
    def multiplexed(self) -> bool:
        return len(self.channels) > 1

    # -- front ends -> core -------------------------------------------------

    async def read(self, inputs: anyio.abc.ObjectSendStream[ToCore]) -> None:
        """Every front end's messages -> the core's ``inputs``; the end of the
        primary's connection (or its Shutdown) closes them."""
        async with anyio.create_task_group() as tg:
            for index in range(1, len(self.channels)):
                tg.start_soon(self._read_attached, index, inputs)
            await self._read_primary(inputs)

    async def _read_primary(self, inputs: anyio.abc.ObjectSendStream[ToCore]) -> None:
        async with inputs:
            while True:
                try:
                    message = await self.channels[PRIMARY].receive()
                except PEER_LEFT:
                    return
                await self._forward(PRIMARY, message, inputs)
                if isinstance(message, Shutdown):
                    return

    async def _read_attached(self, index: int, inputs: anyio.abc.ObjectSendStream[ToCore]) -> None:
        try:
            while not isinstance(message := await self.channels[index].receive(), Shutdown):
                await self._forward(index, message, inputs)
        except PEER_GONE:  # ClosedResourceError: the core stopped and closed it
            pass
        await self._leave(index, inputs)

    async def _forward(
        self, index: int, message: ToCore, inputs: anyio.abc.ObjectSendStream[ToCore]
    ) -> None:
        if not self.multiplexed:
            await inputs.send(message)
        elif isinstance(message, CoreInputs):
            await inputs.send(self._claim(index, message))
        elif isinstance(message, WaitIdle):
            ticket = next(self._next_ticket)
            self._tickets[ticket] = (index, message.ticket)
            await inputs.send(WaitIdle(ticket))
        else:
            await inputs.send(message)  # the primary's Shutdown (or a CoreSetup: refused there)

    def _claim(self, index: int, message: CoreInputs) -> CoreInputs:
        """The front end's inputs with its new requests recorded as its own
        (their client prefixed with the front end's number: ``"1/addr"``),
        an id another front end has in flight refused, and its aborts and
        stops kept to its own requests."""
        owner = self._owner
        new: list[EngineCoreRequest] = []
        refused: list[RejectedRequest] = []
        for request in message.new_requests:
            holder = owner.setdefault(request.request_id, index)
            if holder == index:
                new.append(msgspec.structs.replace(request, client=f"{index}/{request.client}"))
            else:
                error = f"request id {request.request_id!r} is already in flight"
                refused.append(RejectedRequest(request.request_id, error))
        if refused:
            self._route(index, CoreOutputs(-1, [], self._stats, refused))
        ended = [
            [rid for rid in ids if owner.get(rid) == index]
            for ids in (message.aborted, message.stopped)
        ]
        for rid in itertools.chain(*ended):
            del owner[rid]
        return CoreInputs(new, ended[0], ended[1])

    async def _leave(self, index: int, inputs: anyio.abc.ObjectSendStream[ToCore]) -> None:
        """An attached front end went away: abort its requests."""
        self._gone.add(index)
        self._outboxes[index].close()
        mine = [rid for rid, holder in self._owner.items() if holder == index]
        for rid in mine:
            del self._owner[rid]
        log.info("front end left", front_end=index, aborted=len(mine))
        if mine:
            with contextlib.suppress(anyio.ClosedResourceError):  # the core is stopping anyway
                await inputs.send(CoreInputs(aborted=mine))

    # -- core -> front ends -------------------------------------------------

    async def write(self, events: anyio.abc.ObjectReceiveStream[FromCore]) -> None:
        """The core's ``events`` -> their front ends, until the core closes
        them and every outbox is written. A broken primary connection
        raises; a broken attached one is that front end leaving."""
        async with anyio.create_task_group() as tg:
            for index in range(len(self.channels)):
                tg.start_soon(self._write_one, index)
            async with events:
                async for message in events:
                    self._dispatch(message)
            for outbox in self._outboxes:
                outbox.close()

    async def _write_one(self, index: int) -> None:
        channel = self.channels[index]
        async with self._inboxes[index] as inbox:
            if index == PRIMARY:
                async for message in inbox:
                    await channel.send(message)
                return
            try:
                async for message in inbox:
                    await channel.send(message)
            except PEER_GONE:
                self._gone.add(index)
        # Its outbox closed: it left, or the core stopped. Closing its
        # connection tells its Engine that it may stop.
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await channel.aclose()

    def _dispatch(self, message: FromCore) -> None:
        if not self.multiplexed:
            self._route(PRIMARY, message)
        elif isinstance(message, CoreOutputs):
            self._split(message)
        elif isinstance(message, Idle):
            owner = self._tickets.pop(message.ticket, None)
            if owner is not None:
                self._route(owner[0], Idle(owner[1], message.stats))
        elif isinstance(message, LoadProgress):
            self._route(PRIMARY, message)
        else:  # CoreReady, CoreFailed
            if isinstance(message, CoreReady):
                self._stats = message.stats
            for index in range(len(self.channels)):
                self._route(index, message)

    def _split(self, message: CoreOutputs) -> None:
        """One step's outputs: each front end its own requests' news."""
        self._stats = message.stats
        owner = self._owner
        outputs: list[list[EngineCoreOutput]] = [[] for _ in self.channels]
        rejected: list[list[RejectedRequest]] = [[] for _ in self.channels]
        for output in message.outputs:
            holder = owner.get(output.request_id)
            if holder is None:
                continue  # aborted or stopped by its front end: nobody waits for it
            outputs[holder].append(output)
            if output.finished:
                del owner[output.request_id]
        for refusal in message.rejected:
            holder = owner.pop(refusal.request_id, None)
            if holder is not None:
                rejected[holder].append(refusal)
        now = time.monotonic()
        for index in range(len(self.channels)):
            if outputs[index] or rejected[index] or now >= self._stats_due[index]:
                self._stats_due[index] = now + STATS_INTERVAL_S
                news = CoreOutputs(message.step_id, outputs[index], message.stats, rejected[index])
                self._route(index, news)

    def _route(self, index: int, message: FromCore) -> None:
        if index not in self._gone:
            self._outboxes[index].send_nowait(message)
