"""Gateways read each other's stored responses over a real NATS (response_peers.py): found
at the gateway that stored it, deleted wherever it is, and a miss answered by the live
gateways at once, never by waiting out a timeout; a gateway that stopped beating is not
waited for."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from llmbus.serve import NatsServer
from services.gateway import response_peers
from services.gateway.response_peers import QUERY_TIMEOUT_S, ResponsePeers
from services.gateway.response_store import ResponseStore
from shared.bus import Subjects, encode
from shared.messages import GatewayHeartbeat, StoredResponse

SUBJECTS = Subjects("tiny")


@pytest.fixture(scope="module")
def bus():
    server = NatsServer().start()
    yield server
    server.stop()


async def gateway(url: str, name: str) -> ResponsePeers:
    nc = await nats.connect(url)
    peers = ResponsePeers(nc, SUBJECTS, ResponseStore(1 << 20), SUBJECTS.outputs(name, "p1"))
    await peers.start()
    return peers


async def beat(*gateways: ResponsePeers) -> None:
    for g in gateways:
        await g.nc.publish(SUBJECTS.gateway_heartbeat, encode(GatewayHeartbeat(g.me)))
    for g in gateways:
        await g.nc.flush()
    await asyncio.sleep(0.05)


def test_a_gateway_finds_and_deletes_what_another_stored(bus):
    async def run():
        a, b, c = [await gateway(bus.url, name) for name in ("a", "b", "c")]
        entry = StoredResponse(b'{"id": "resp_1"}', b"[]")
        a.store.put("resp_1", entry)
        assert await b.find("resp_1") is None  # (no peer heard from yet: nothing asked)
        await beat(a, b, c)
        assert (a.peers(), b.peers()) == (2, 2)
        assert await b.find("resp_1") == entry and len(b.store) == 0  # (read, not copied)
        started = time.monotonic()
        assert await c.find("resp_2") is None
        missed_in = time.monotonic() - started
        assert missed_in < QUERY_TIMEOUT_S / 2  # each live gateway said no: no timeout waited
        assert await c.delete("resp_1") is True and await a.find("resp_1") is None
        assert await c.delete("resp_1") is False
        for g in (a, b, c):
            await g.nc.close()

    asyncio.run(run())


def test_a_gateway_that_stopped_beating_is_not_waited_for(bus, monkeypatch):
    monkeypatch.setattr(response_peers, "PEER_TIMEOUT_S", 0.3)

    async def run():
        a, b = await gateway(bus.url, "a"), await gateway(bus.url, "b")
        await beat(a, b)
        await b.nc.close()  # b dies: its heartbeat still counts, for a while
        assert a.peers() == 1
        started = time.monotonic()
        assert await a.find("resp_9") is None
        assert time.monotonic() - started >= QUERY_TIMEOUT_S * 0.9  # (waited for b, which never answered)
        await asyncio.sleep(0.35)
        assert a.peers() == 0
        started = time.monotonic()
        assert await a.find("resp_9") is None and time.monotonic() - started < 0.1
        await a.nc.close()

    asyncio.run(run())
