"""The stored responses of all of a deployment's gateways, read as one store: a response
retrieved, deleted or gone on from (previous_response_id) at one gateway may have been
stored by another — replicas behind a balancer, or `--api-server-count` siblings, each
client request landing where it may.

Every gateway answers `responses` questions from its own store, found or not; one that
does not hold an id asks the live others (peers.py) and stops at the first that has it.
"""

from __future__ import annotations

import msgspec

from services.gateway.shell.peers import GatewayPeers
from services.gateway.responses_api.store import ResponseStore, StoredHere
from shared.bus import encode
from shared.messages import StoredResponse, StoredResponseAnswer, StoredResponseQuery

_answer = msgspec.msgpack.Decoder(StoredResponseAnswer)
_query = msgspec.msgpack.Decoder(StoredResponseQuery)


class ResponsePeers(StoredHere):
    def __init__(self, store: ResponseStore) -> None:
        super().__init__(store)
        self.peers: GatewayPeers | None = None  # (set by start: the others, over the bus)

    async def start(self, peers: GatewayPeers) -> None:
        self.peers = peers
        await peers.nc.subscribe(peers.subjects.responses, cb=self._on_query)

    async def find(self, response_id: str) -> StoredResponse | None:
        """The response stored under this id here or at another gateway; None if none has it."""
        entry = self.store.get(response_id)
        if entry is None:
            answers = await self._ask(StoredResponseQuery(response_id, self._me()), stop_when_found=True)
            entry = next((a.stored for a in answers if a.found), None)
        return entry

    async def delete(self, response_id: str) -> bool:
        """Dropped wherever it is stored (a client-named id may be at several); False if nowhere."""
        here = self.store.delete(response_id)
        answers = await self._ask(StoredResponseQuery(response_id, self._me(), delete=True), stop_when_found=False)
        return here or any(a.found for a in answers)

    async def _ask(self, query: StoredResponseQuery, stop_when_found: bool) -> list[StoredResponseAnswer]:
        if self.peers is None:
            return []
        await self.peers.heard_all()
        answers: list[StoredResponseAnswer] = []

        def settles(data: bytes) -> bool:  # (each answer decoded once, as it comes)
            try:
                answers.append(_answer.decode(data))
            except msgspec.DecodeError:
                return False
            return stop_when_found and answers[-1].found

        await self.peers.gather(self.peers.subjects.responses, encode(query), self.peers.live(), settles)
        return answers

    def _me(self) -> str:
        return self.peers.me if self.peers is not None else ""

    async def _on_query(self, msg) -> None:
        try:
            query = _query.decode(msg.data)
        except msgspec.DecodeError:
            return
        if query.asker == self.peers.me or not msg.reply:
            return  # (its own question: it looked in its store first)
        if query.delete:
            answer = StoredResponseAnswer(self.store.delete(query.response_id))
        else:
            entry = self.store.get(query.response_id)
            answer = StoredResponseAnswer(entry is not None, entry)
        await msg.respond(encode(answer))
