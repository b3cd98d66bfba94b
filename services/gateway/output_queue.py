"""A request's queue of engine outputs at the gateway (the engine client fills it, the
request's generator reads it)."""

from __future__ import annotations

import asyncio
from collections import deque


class OutputQueue:
    """A request's outputs as they arrive, for its one reader: asyncio.Queue's put_nowait,
    get_nowait, get and empty without its bookkeeping for many getters and a size bound
    (a streamed token passes through one)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self):
        return self._items.popleft()  # (IndexError where empty: ask `empty` first)

    def empty(self) -> bool:
        return not self._items

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()
