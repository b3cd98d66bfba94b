"""NATS plumbing every service shares: subjects, codecs, connecting, signals."""

from __future__ import annotations

import asyncio
import logging
import re
import signal

import msgspec
import nats
from nats.aio.client import Client

log = logging.getLogger("llmbus.bus")

encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return encoder.encode(message)


class Subjects:
    """Every subject of one deployment: `llmbus.<model>.…`, so deployments can share a NATS."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.prefix = f"llmbus.{subject_token(model)}"
        self.tokenize = f"{self.prefix}.tokenize"  # request/reply, tokenizer queue group
        self.requests = f"{self.prefix}.requests"  # gateway -> scheduler: EngineCoreRequest
        self.abort = f"{self.prefix}.abort"  # gateway -> scheduler: AbortRequests
        self.announce = f"{self.prefix}.workers.announce"  # worker -> scheduler: WorkerInfo
        self.scheduler_hello = f"{self.prefix}.scheduler.hello"  # scheduler -> workers: announce!
        self.scheduler_info = f"{self.prefix}.scheduler.info"  # request/reply: SchedulerInfo
        self.scheduler_heartbeat = f"{self.prefix}.scheduler.heartbeat"  # SchedulerHeartbeat
        self.scheduler_stats = f"{self.prefix}.scheduler.stats"  # SchedulerStats, steadily and on change

    def step(self, worker_id: str) -> str:
        return f"{self.prefix}.workers.{worker_id}.step"  # request/reply: SchedulerOutput

    def outputs(self, gateway_id: str) -> str:
        return f"{self.prefix}.outputs.{gateway_id}"  # scheduler -> gateway: EngineCoreOutputs


def subject_token(name: str) -> str:
    """A model name as one NATS subject token (no dots, spaces or wildcards)."""
    token = re.sub(r"[^A-Za-z0-9_-]", "_", name).strip("_")
    return token or "model"


async def connect(url: str, name: str, on_reconnect=None) -> Client:
    """Connect with reconnection forever: a NATS restart is an outage, not a crash.

    `on_reconnect` (async) runs after each reconnection: messages in flight across the gap
    may be lost, and the caller decides what that means for its work.
    """

    async def on_disconnect():
        if not (nc.is_closed or nc.is_draining):  # a drain on shutdown is not news
            log.warning("%s disconnected from NATS", name)

    async def on_reconnected():
        log.warning("%s reconnected to NATS at %s", name, nc.connected_url.netloc if nc.connected_url else url)
        if on_reconnect is not None:
            await on_reconnect()

    async def on_error(exc):
        log.debug("NATS error: %s", exc)

    nc = await nats.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()],  # a cluster: every node
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        connect_timeout=5,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnected,
        error_cb=on_error,
    )
    log.info("%s connected to NATS at %s", name, url)
    return nc


async def close(nc: Client) -> None:
    """Drain on the way out; a bus that is already gone (stopped first, or restarting) is
    no error at shutdown, and no traceback."""
    try:
        await nc.drain()
    except Exception as exc:  # noqa: BLE001 - nats-py raises several kinds here
        log.debug("NATS drain at shutdown: %s: %s", type(exc).__name__, exc)
        try:
            await nc.close()
        except Exception:  # noqa: BLE001
            pass


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM, so a service can drain and exit cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
