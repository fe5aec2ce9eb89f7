"""A queue fair between its clients: each client's items in the order they
came, the clients served in turn.

The next item taken (:meth:`FairQueue.get`) is the first of the client with
the fewest items in service (taken, and not yet :meth:`FairQueue.done`),
and among those the one whose turn it is: a client's turn comes again after
every other's once an item of it is done, and a client new to the queue
takes its turn after the clients already in it. So with one server, an item
of a client with nothing else queued waits for the item in service and for
no other (whoever queued many); one client alone keeps every server busy.
Items can be withdrawn before they are taken (:meth:`FairQueue.remove`).
Imports anyio only.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

import anyio

Item = TypeVar("Item")


class FairQueue(Generic[Item]):
    """Items by client (any hashable key), taken in turn (see the module doc)."""

    def __init__(self) -> None:
        #: Each client's items waiting.
        self._queues: dict[Hashable, deque[Item]] = {}
        #: The clients in the order of their turns (those waiting or in service).
        self._turns: dict[Hashable, None] = {}
        #: Items in service, by client.
        self._in_service: Counter[Hashable] = Counter()
        self._put = anyio.Event()

    def __len__(self) -> int:
        return sum(len(items) for items in self._queues.values())

    def put(self, client: Hashable, item: Item) -> None:
        """Queue ``item`` after ``client``'s others."""
        self._queues.setdefault(client, deque()).append(item)
        self._turns.setdefault(client, None)
        self._put.set()

    def remove(self, client: Hashable, item: Item) -> bool:
        """Withdraw ``item`` if it is still queued; whether it was."""
        items = self._queues.get(client)
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del self._queues[client]
            self._forget_if_idle(client)
        return True

    def get_nowait(self) -> tuple[Hashable, Item]:
        """The next item and its client (see the module doc);
        ``anyio.WouldBlock`` when none waits."""
        if not self._queues:
            raise anyio.WouldBlock
        fewest = min(self._in_service[c] for c in self._queues)
        client = next(c for c in self._turns if c in self._queues and self._in_service[c] == fewest)
        items = self._queues[client]
        item = items.popleft()
        if not items:
            del self._queues[client]
        self._in_service[client] += 1
        return client, item

    async def get(self) -> tuple[Hashable, Item]:
        """The next item and its client, waiting for one."""
        await anyio.lowlevel.checkpoint()
        while not self._queues:  # several getters wake: the first takes it
            if self._put.is_set():
                self._put = anyio.Event()
            await self._put.wait()
        return self.get_nowait()

    def done(self, client: Hashable) -> None:
        """An item taken from ``client`` is done: its next turn comes after
        every other client's."""
        self._in_service[client] -= 1
        if self._in_service[client] <= 0:
            del self._in_service[client]
        self._turns.pop(client, None)
        self._turns[client] = None
        self._forget_if_idle(client)

    def _forget_if_idle(self, client: Hashable) -> None:
        if client not in self._queues and client not in self._in_service:
            self._turns.pop(client, None)
