"""The deployment's other gateways, as one gateway sees them: known by their heartbeats
(each gateway's, twice a second, on `gateways.heartbeat`, with its outputs subject and its
sibling group: the gateways one `llmbus serve --api-server-count N` runs on one port), and
asked questions that each live one answers (`gather`).

A question waits for the answers of the live gateways only, and may stop at the first that
settles it: an answer costs a round trip, never a timeout, and with nobody to ask nothing
is sent. A gateway that died is counted until its heartbeats have been missing for
PEER_TIMEOUT_S; a question waits at most QUERY_TIMEOUT_S, so such a gateway delays an
answer and never loses one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.errors import TimeoutError as NatsTimeout

from shared.bus import Subjects
from shared.messages import GatewayHeartbeat

log = logging.getLogger("llmbus.gateway")

PEER_TIMEOUT_S = 2.0  # a gateway's heartbeats come twice a second
QUERY_TIMEOUT_S = 1.0
HEARD_ALL_S = 0.75  # from its start, when a gateway has heard every live one's heartbeat


class GatewayPeers:
    def __init__(self, nc, subjects: Subjects, me: str, group: str = "") -> None:
        self.nc = nc
        self.subjects = subjects
        self.me = me  # this gateway's outputs subject, which its heartbeats carry
        self.group = group  # its siblings' ("" when it has none)
        self._seen: dict[str, tuple[str, float]] = {}  # outputs subject -> (group, last heard)
        self._beat = msgspec.msgpack.Decoder(GatewayHeartbeat)
        self._started_at = time.monotonic()

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.gateway_heartbeat, cb=self._on_heartbeat)
        self._started_at = time.monotonic()

    async def heard_all(self) -> None:
        """Returns once every live gateway has been heard: at once, but in a gateway's first
        moments (one just restarted would take the others for absent, and a stored
        response for missing)."""
        wait = HEARD_ALL_S - (time.monotonic() - self._started_at)
        if wait > 0:
            await asyncio.sleep(wait)

    def live(self, siblings_only: bool = False) -> int:
        """How many other gateways are alive (of this one's sibling group, or any)."""
        now = time.monotonic()
        return sum(1 for subject, (group, seen) in self._seen.items()
                   if subject != self.me and now - seen < PEER_TIMEOUT_S
                   and (not siblings_only or group == self.group))

    async def gather(self, subject: str, question: bytes, expected: int,
                     settles: Callable[[bytes], bool] = lambda _: False) -> list[bytes]:
        """The answers of `expected` gateways to a question published on `subject`, or
        fewer: up to the first that `settles` it, or those in by QUERY_TIMEOUT_S."""
        if not expected or not self.nc.is_connected:
            return []
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, max_msgs=expected)
        answers: list[bytes] = []
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        try:
            await self.nc.publish(subject, question, reply=inbox)
            while len(answers) < expected:
                msg = await sub.next_msg(timeout=max(0.001, deadline - time.monotonic()))
                answers.append(msg.data)
                if settles(msg.data):
                    break
        except (NatsTimeout, asyncio.TimeoutError):
            log.warning("%s: %d of %d other gateway(s) answered within %.1f s", subject.rsplit(".", 1)[-1],
                        len(answers), expected, QUERY_TIMEOUT_S)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # (already done: it got its max_msgs)
                pass
        return answers

    async def _on_heartbeat(self, msg) -> None:
        try:
            beat = self._beat.decode(msg.data)
        except msgspec.DecodeError:
            return
        self._seen[beat.reply_subject] = (beat.group, time.monotonic())
        if len(self._seen) > 64:  # restarted gateways' old subjects, gone for good
            now = time.monotonic()
            self._seen = {s: (g, t) for s, (g, t) in self._seen.items() if now - t < PEER_TIMEOUT_S}
