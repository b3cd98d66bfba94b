"""The Responses API's stored responses: what `store` keeps, `previous_response_id` goes
on from, and `GET`/`DELETE /v1/responses/{id}` read and drop.

Kept by the gateway that answered, in its memory, as vLLM keeps them in its API server's
(a gateway that restarts has lost its own); the deployment's other gateways ask it for
one they do not hold (response_peers.py), so a conversation may go on at any of them.
Unlike vLLM's (which never drops one), the store is bounded: beyond `--responses-store-mb`
the least recently used go first, so a long-running gateway cannot grow without end.

Each entry is held as encoded JSON, so its size is exactly what it costs and a read gives
back the bytes a client was sent. It keeps the whole conversation so far (earlier turns,
its input, its output as chat messages): a response goes on from one entry alone, and
dropping an older turn never breaks a newer one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from shared.messages import StoredResponse

log = logging.getLogger("llmbus.gateway")


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self.delete(response_id)  # (a client-named id sent again: the newer answer)
        if entry.size > self.max_bytes:
            log.warning("response %s (%d bytes) is larger than the whole store (--responses-store-mb): not stored",
                        response_id, entry.size)
            return
        self._entries[response_id] = entry
        self.num_bytes += entry.size
        while self.num_bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)  # read: used, so kept longest
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.size
        return True


class StoredHere:
    """The stored responses of this gateway alone (shell/response_peers.py asks the others too)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def find(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
