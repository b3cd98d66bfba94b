"""The stored responses of all of a deployment's gateways, read as one store: a response
retrieved, deleted or gone on from (previous_response_id) at one gateway may have been
stored by another — replicas behind a balancer, each client request landing where it may.

Over the bus: every gateway answers `responses` queries from its own store (found or not),
and one that does not hold an id asks the others. It knows them by their heartbeats (each
gateway's, twice a second, on `gateways.heartbeat`), so it waits for the answers of the
live ones only, and returns at the first that has the response: a miss costs a round
trip, not a timeout, and with no other gateway, nothing. A peer that died is counted
until its heartbeats have been missing for PEER_TIMEOUT_S; a query waits at most
QUERY_TIMEOUT_S, so such a peer delays an answer and never loses one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.errors import TimeoutError as NatsTimeout

from services.gateway.response_store import ResponseStore
from shared.bus import Subjects, encode
from shared.messages import GatewayHeartbeat, StoredResponse, StoredResponseAnswer, StoredResponseQuery

log = logging.getLogger("llmbus.gateway")

PEER_TIMEOUT_S = 2.0  # a gateway's heartbeats come twice a second
QUERY_TIMEOUT_S = 1.0


class ResponsePeers:
    def __init__(self, nc, subjects: Subjects, store: ResponseStore, me: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.store = store
        self.me = me  # this gateway's outputs subject, which its heartbeats carry
        self._seen: dict[str, float] = {}  # a peer's outputs subject -> when it was last heard
        self._beat = msgspec.msgpack.Decoder(GatewayHeartbeat)
        self._query = msgspec.msgpack.Decoder(StoredResponseQuery)
        self._answer = msgspec.msgpack.Decoder(StoredResponseAnswer)

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.gateway_heartbeat, cb=self._on_heartbeat)
        await self.nc.subscribe(self.subjects.responses, cb=self._on_query)

    def peers(self) -> int:
        """How many other gateways are alive."""
        now = time.monotonic()
        return sum(1 for subject, seen in self._seen.items() if subject != self.me and now - seen < PEER_TIMEOUT_S)

    async def find(self, response_id: str) -> StoredResponse | None:
        """The response stored under this id here or at another gateway; None if none has it."""
        entry = self.store.get(response_id)
        if entry is None:
            answers = await self._ask(StoredResponseQuery(response_id, self.me), until_found=True)
            entry = next((a.stored for a in answers if a.found), None)
        return entry

    async def delete(self, response_id: str) -> bool:
        """Dropped wherever it is stored (a client-named id may be at several); False if nowhere."""
        here = self.store.delete(response_id)
        answers = await self._ask(StoredResponseQuery(response_id, self.me, delete=True), until_found=False)
        return here or any(a.found for a in answers)

    async def _ask(self, query: StoredResponseQuery, until_found: bool) -> list[StoredResponseAnswer]:
        expected = self.peers()
        if not expected or not self.nc.is_connected:
            return []
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=expected)
        answers: list[StoredResponseAnswer] = []
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        try:
            await self.nc.publish(self.subjects.responses, encode(query), reply=inbox)
            while len(answers) < expected:
                msg = await sub.next_msg(timeout=max(0.001, deadline - time.monotonic()))
                try:
                    answers.append(self._answer.decode(msg.data))
                except msgspec.DecodeError:
                    continue
                if until_found and answers[-1].found:
                    break
        except (NatsTimeout, asyncio.TimeoutError):
            log.warning("response %s: %d of %d other gateway(s) answered within %.1f s", query.response_id,
                        len(answers), expected, QUERY_TIMEOUT_S)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # (already done: it got its max_msgs)
                pass
        return answers

    async def _on_heartbeat(self, msg) -> None:
        try:
            self._seen[self._beat.decode(msg.data).reply_subject] = time.monotonic()
        except msgspec.DecodeError:
            return
        if len(self._seen) > 64:  # restarted gateways' old subjects, gone for good
            now = time.monotonic()
            self._seen = {s: t for s, t in self._seen.items() if now - t < PEER_TIMEOUT_S}

    async def _on_query(self, msg) -> None:
        try:
            query = self._query.decode(msg.data)
        except msgspec.DecodeError:
            return
        if query.asker == self.me or not msg.reply:
            return  # (its own query: it looked in its store first)
        if query.delete:
            answer = StoredResponseAnswer(self.store.delete(query.response_id))
        else:
            entry = self.store.get(query.response_id)
            answer = StoredResponseAnswer(entry is not None, entry)
        await msg.respond(encode(answer))
