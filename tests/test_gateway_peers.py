"""Gateways as each other's peers over a real NATS (peers.py): stored responses found at
the gateway that stored it and deleted wherever it is, a miss answered by the live
gateways at once, never by waiting out a timeout, a gateway that stopped beating not
waited for; and sibling gateways' metrics merged as one port's."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from llmbus.deploy.serve import NatsServer
from services.gateway.shell import peers as gateway_peers
from finished_usage import finished_usage
from services.gateway.metrics import GatewayMetrics
from services.gateway.shell.peers import QUERY_TIMEOUT_S, GatewayPeers
from services.gateway.shell.response_peers import ResponsePeers
from services.gateway.responses_api.store import ResponseStore
from shared.bus import Subjects, encode
from shared.messages import GatewayHeartbeat, SchedulerStats, StoredResponse

SUBJECTS = Subjects("tiny")


@pytest.fixture(scope="module")
def bus():
    server = NatsServer().start()
    yield server
    server.stop()


async def gateway(url: str, name: str) -> ResponsePeers:
    peers = GatewayPeers(await nats.connect(url), SUBJECTS, SUBJECTS.outputs(name, "p1"))
    await peers.start()
    responses = ResponsePeers(ResponseStore(1 << 20))
    await responses.start(peers)
    await peers.nc.flush()  # (its subscriptions in place before anyone speaks)
    return responses


async def beat(*gateways: ResponsePeers) -> None:
    """Each gateway's heartbeat, once, heard by all (as a gateway sends it twice a second)."""
    for g in gateways:
        await g.peers.nc.publish(SUBJECTS.gateway_heartbeat, encode(GatewayHeartbeat(g.peers.me)))
    for g in gateways:
        await g.peers.nc.flush()
    deadline = time.monotonic() + 5
    while any(g.peers.live() < len(gateways) - 1 for g in gateways) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_a_gateway_finds_and_deletes_what_another_stored(bus):
    async def run():
        a, b, c = [await gateway(bus.url, name) for name in ("a", "b", "c")]
        entry = StoredResponse(b'{"id": "resp_1"}', b"[]")
        a.store.put("resp_1", entry)
        assert await b.find("resp_1") is None  # (no peer heard from yet: nothing asked)
        await beat(a, b, c)
        assert (a.peers.live(), b.peers.live()) == (2, 2)
        assert await b.find("resp_1") == entry and len(b.store) == 0  # (read, not copied)
        started = time.monotonic()
        assert await c.find("resp_2") is None
        missed_in = time.monotonic() - started
        assert missed_in < QUERY_TIMEOUT_S / 2  # each live gateway said no: no timeout waited
        await beat(a, b, c)  # (still alive, as their heartbeats would say)
        assert await c.delete("resp_1") is True and await a.find("resp_1") is None
        assert await c.delete("resp_1") is False
        for g in (a, b, c):
            await g.peers.nc.close()

    asyncio.run(run())


def test_a_gateway_that_stopped_beating_is_not_waited_for(bus, monkeypatch):
    # The clock is the peers' PEER_TIMEOUT_S, not a sleep: long while b's heartbeat must still
    # count (a loaded CI machine once stalled past a 1.5 s one between b's beat and the first
    # look), then short, as if its heartbeats had been missing for that long.
    monkeypatch.setattr(gateway_peers, "PEER_TIMEOUT_S", 600.0)
    monkeypatch.setattr(gateway_peers, "HEARD_ALL_S", 0.0)  # (not a gateway's first moments: test_..._just_started)

    async def run():
        a, b = await gateway(bus.url, "a"), await gateway(bus.url, "b")
        await beat(a, b)
        await b.peers.nc.close()  # b dies: its heartbeat still counts, for a while
        assert a.peers.live() == 1
        started = time.monotonic()
        assert await a.find("resp_9") is None
        assert time.monotonic() - started >= QUERY_TIMEOUT_S * 0.9  # (waited for b, which never answered)
        monkeypatch.setattr(gateway_peers, "PEER_TIMEOUT_S", 0.001)  # (b's heartbeats missing that long)
        await asyncio.sleep(0.01)
        assert a.peers.live() == 0
        started = time.monotonic()
        assert await a.find("resp_9") is None and time.monotonic() - started < QUERY_TIMEOUT_S / 2
        await a.peers.nc.close()

    asyncio.run(run())


def test_a_gateway_just_started_waits_to_hear_the_others(monkeypatch):
    """Before a gateway has heard the others' heartbeats (twice a second), it does not take
    them for absent: a response stored at another is found by one that has just started."""
    # (a's beat 0.3 s in: 1.7 s to spare on a loaded machine, where 0.75 s left 0.45 s)
    monkeypatch.setattr(gateway_peers, "HEARD_ALL_S", 2.0)

    async def run(url):
        a = await gateway(url, "a")
        entry = StoredResponse(b'{"id": "resp_1"}', b"[]")
        a.store.put("resp_1", entry)
        c = await gateway(url, "c")

        async def a_beats_soon():
            await asyncio.sleep(0.3)
            await beat(a)

        soon = asyncio.ensure_future(a_beats_soon())
        assert await c.find("resp_1") == entry
        await soon
        for g in (a, c):
            await g.peers.nc.close()

    server = NatsServer().start()
    try:
        asyncio.run(run(server.url))
    finally:
        server.stop()


def test_siblings_metrics_merge_as_one_ports():
    """Request-level families summed over the siblings (each saw its own requests); the
    scheduler's, which each reads from the same stats, the longest-running one's (largest);
    a gateway alone renders exactly as before."""
    older, newer = GatewayMetrics("tiny"), GatewayMetrics("tiny")
    older.observe_stats(SchedulerStats(scheduler_id="s1", num_running_reqs=3, prefix_cache_queries=100))
    for stats in (SchedulerStats(scheduler_id="s1", num_running_reqs=2, prefix_cache_queries=150),):
        older.observe_stats(stats)
        newer.observe_stats(stats)  # (started later: it saw the counts grow by less)
    older.request_finished(finished_usage([5], [2], "stop"))
    newer.request_finished(finished_usage([7], [3], "length"))
    text = older.merged([newer.families()]).decode()

    def value(sample: str) -> float:
        [line] = [line for line in text.splitlines() if line.startswith(sample + " ")]
        return float(line.rsplit(" ", 1)[1])

    assert value('llmbus:prompt_tokens_total{model_name="tiny"}') == 12
    assert value('llmbus:request_success_total{finished_reason="stop",model_name="tiny"}') == 1
    assert value('llmbus:request_success_total{finished_reason="length",model_name="tiny"}') == 1
    assert value('llmbus:inter_token_latency_seconds_count{model_name="tiny"}') == 3
    assert value('llmbus:prefix_cache_queries_total{engine="0",model_name="tiny",scheduler="s1"}') == 150
    assert value('llmbus:num_requests_running{engine="0",model_name="tiny",scheduler="s1"}') == 2
    assert older.merged([]) == older.render()
