"""A port's /metrics across its sibling gateways (`llmbus serve --api-server-count N`):
whichever sibling a scrape reaches asks the live others for their figures (peers.py) and
answers with all of them merged (GatewayMetrics.merged); a gateway without siblings
answers with its own, as always."""

from __future__ import annotations

import msgspec

from services.gateway.metrics import GatewayMetrics, OwnMetrics
from services.gateway.shell.peers import GatewayPeers
from shared.bus import encode
from shared.messages import MetricsQuery

_query = msgspec.msgpack.Decoder(MetricsQuery)


class SiblingMetrics(OwnMetrics):
    def __init__(self, metrics: GatewayMetrics) -> None:
        super().__init__(metrics)
        self.peers: GatewayPeers | None = None  # (set by start: siblings, over the bus)

    async def start(self, peers: GatewayPeers) -> None:
        if peers.group:
            self.peers = peers
            await peers.nc.subscribe(peers.subjects.gateway_metrics, cb=self._on_query)

    async def exposition(self) -> bytes:
        if self.peers is not None:
            await self.peers.heard_all()
        siblings = self.peers.live(siblings_only=True) if self.peers is not None else 0
        if not siblings:
            return self.metrics.render()
        question = encode(MetricsQuery(self.peers.me, self.peers.group))
        return self.metrics.merged(await self.peers.gather(self.peers.subjects.gateway_metrics, question, siblings))

    async def _on_query(self, msg) -> None:
        try:
            query = _query.decode(msg.data)
        except msgspec.DecodeError:
            return
        if msg.reply and query.group == self.peers.group and query.asker != self.peers.me:
            await msg.respond(self.metrics.families())
