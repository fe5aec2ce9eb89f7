"""A queue fair between its clients: round robin over the clients with
items waiting, each client's own items in the order they came.

One client's many items cannot starve another's: an item of a client that
had nothing queued is taken after at most one item of each other client
already waiting. Items are taken by any number of tasks
(:meth:`FairQueue.get`); an item can be withdrawn before it is taken
(:meth:`FairQueue.remove`). Imports anyio only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

import anyio

Item = TypeVar("Item")


class FairQueue(Generic[Item]):
    """Items by client (any hashable key), taken round robin over the clients."""

    def __init__(self) -> None:
        #: Each client's items, the client whose turn it is first.
        self._queues: dict[Hashable, deque[Item]] = {}
        self._put = anyio.Event()

    def __len__(self) -> int:
        return sum(len(items) for items in self._queues.values())

    def put(self, client: Hashable, item: Item) -> None:
        """Queue ``item`` after ``client``'s others (a client new to the
        queue takes its turn after those waiting)."""
        self._queues.setdefault(client, deque()).append(item)
        self._put.set()

    def remove(self, client: Hashable, item: Item) -> bool:
        """Withdraw ``item`` if it is still queued; whether it was."""
        items = self._queues.get(client)
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del self._queues[client]
        return True

    def get_nowait(self) -> Item:
        """The next item: the first of the client whose turn it is (that
        client's turn then comes after every other's); ``anyio.WouldBlock``
        when none waits."""
        if not self._queues:
            raise anyio.WouldBlock
        client = next(iter(self._queues))
        items = self._queues.pop(client)
        item = items.popleft()
        if items:
            self._queues[client] = items  # to the end of the round
        return item

    async def get(self) -> Item:
        """The next item, waiting for one."""
        await anyio.lowlevel.checkpoint()
        while not self._queues:  # several getters wake: the first takes it
            if self._put.is_set():
                self._put = anyio.Event()
            await self._put.wait()
        return self.get_nowait()
