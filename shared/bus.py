"""NATS plumbing every service shares: subjects, codecs, connecting, signals."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import ssl
import threading
import time
from dataclasses import dataclass

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
        self.announce = f"{self.prefix}.workers.announce"  # worker -> scheduler: WorkerInfo
        self.scheduler_hello = f"{self.prefix}.scheduler.hello"  # scheduler -> workers: announce!
        self.scheduler_info = f"{self.prefix}.scheduler.info"  # request/reply: SchedulerInfo
        self.scheduler_heartbeat = f"{self.prefix}.scheduler.heartbeat"  # SchedulerHeartbeat
        self.scheduler_stats = f"{self.prefix}.scheduler.stats"  # SchedulerStats, steadily and on change
        self.gateway_heartbeat = f"{self.prefix}.gateways.heartbeat"  # gateway -> scheduler, gateways: GatewayHeartbeat
        self.responses = f"{self.prefix}.responses"  # gateway -> gateways: StoredResponseQuery, each answers
        self.gateway_metrics = f"{self.prefix}.gateways.metrics"  # gateway -> its siblings: MetricsQuery

    def requests(self, rank: int = 0) -> str:
        """gateway -> scheduler shard `rank` (--data-parallel-rank): EngineCoreRequest."""
        return f"{self.prefix}.requests.{rank}"

    def abort(self, rank: int = 0) -> str:
        """gateway -> scheduler shard `rank`: AbortRequests."""
        return f"{self.prefix}.abort.{rank}"

    def kv_events(self, rank: int = 0) -> str:
        """scheduler shard `rank` -> anyone: KVEventBatch (shared/kv_events.py)."""
        return f"{self.prefix}.kv_events.{rank}"

    def kv_snapshot(self, rank: int = 0) -> str:
        """request/reply, scheduler shard `rank`: KVEventSnapshot."""
        return f"{self.prefix}.kv_snapshot.{rank}"

    def step(self, worker_id: str) -> str:
        return f"{self.prefix}.workers.{worker_id}.step"  # request/reply: SchedulerOutput

    def outputs(self, gateway_id: str, incarnation: str) -> str:
        """scheduler -> gateway: EngineCoreOutputs. The gateway's id (its bus identity, kept
        across restarts by `llmbus serve`) and its process's own token: a restarted gateway
        reads none of its dead predecessor's outputs, whose requests the scheduler drops."""
        return f"{self.prefix}.outputs.{gateway_id}.{incarnation}"


def subject_token(name: str) -> str:
    """A model name as one NATS subject token (no dots, spaces or wildcards)."""
    token = re.sub(r"[^A-Za-z0-9_-]", "_", name).strip("_")
    return token or "model"


class BusRefused(RuntimeError):
    """A service could not log in to NATS when it first connected: its credentials were
    refused, or the server's TLS certificate failed the check."""


def inbox_of(user: str) -> str:
    """A user's inbox: `_INBOX.<role>.<instance>` for `<role>-<instance>` (llmbus's
    identities, llmbus/deploy/nats_auth.py), `_INBOX.<user>` for a name without a dash. The role
    is a token of its own so that one grant can name every gateway's inbox
    (`_INBOX.gateway.>`) and nobody else's: NATS wildcards match whole tokens only."""
    return "_INBOX." + user.replace("-", ".", 1)


@dataclass(frozen=True, slots=True)
class BusAuth:
    """How a service proves who it is to NATS (a user and password, a token, or a JWT/nkey
    creds file) and how it checks the server (TLS with a CA, and a client certificate if
    the server asks for one). `inbox_prefix` is where its requests' replies come back:
    `inbox_of(user)` for a user, so a permission can grant it that and no one else's."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox: str | None = None

    @property
    def inbox_prefix(self) -> str:
        return self.inbox or (inbox_of(self.user) if self.user else "_INBOX")

    def connect_options(self) -> dict:
        options: dict = {"inbox_prefix": self.inbox_prefix}
        if self.user:
            options.update(user=self.user, password=self.password)
        if self.token:
            options["token"] = self.token
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.tls_ca or self.tls_cert:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            options["tls"] = context
        return options

    def __repr__(self) -> str:  # never a secret in a log line or a traceback
        return f"BusAuth(user={self.user!r}, tls={bool(self.tls_ca or self.tls_cert)})"


# A first connection that keeps failing is said, not retried in silence (a wrong
# --nats-url looked like a service that hung): once it has failed this long (compose may
# start a service a moment before its NATS), then again at most this often.
UNREACHABLE_WARN_AFTER_S = 5.0
UNREACHABLE_WARN_EVERY_S = 30.0


async def connect(url: str, name: str, on_reconnect=None, auth: BusAuth | None = None) -> Client:
    """Connect with reconnection forever: a NATS restart is an outage, not a crash.

    `on_reconnect` (async) runs after each reconnection: messages in flight across the gap
    may be lost, and the caller decides what that means for its work. Credentials NATS
    refuses, or a server certificate that fails the TLS check, at the first connection
    raise BusRefused (nats-py would retry them forever); a permission a service lacks is
    logged as a warning: the deployment is misconfigured.
    """
    auth = auth or BusAuth()
    refused: asyncio.Future = asyncio.get_running_loop().create_future()
    started, warned_at = time.monotonic(), None

    async def on_disconnect():
        if not (nc.is_closed or nc.is_draining):  # a drain on shutdown is not news
            log.warning("%s disconnected from NATS", name)

    async def on_reconnected():
        log.warning("%s reconnected to NATS at %s", name, nc.connected_url.netloc if nc.connected_url else url)
        if on_reconnect is not None:
            await on_reconnect()

    async def on_error(exc):
        nonlocal warned_at
        text = str(exc).lower()
        # A certificate that fails the check is a refusal; other TLS errors (a handshake cut
        # short by a node going down) are a connection's, and reconnecting deals with them.
        if "authorization violation" in text or "authentication" in text or isinstance(exc, ssl.SSLCertVerificationError):
            if not refused.done():
                refused.set_result(exc)
            log.warning("%s could not log in to NATS: %s", name, exc)
        elif "permissions violation" in text:
            log.warning("%s: %s", name, exc)
        elif not connecting.done() and time.monotonic() - started >= UNREACHABLE_WARN_AFTER_S and (
                warned_at is None or time.monotonic() - warned_at >= UNREACHABLE_WARN_EVERY_S):
            warned_at = time.monotonic()
            log.warning("%s cannot reach NATS at %s for %.0f s (%s); still trying", name, url,
                        warned_at - started, exc)
        else:
            log.debug("NATS error: %s", exc)

    connecting = asyncio.ensure_future(nats.connect(
        servers=[u.strip() for u in url.split(",") if u.strip()],  # a cluster: every node
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        connect_timeout=5,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnected,
        error_cb=on_error,
        **auth.connect_options(),
    ))
    await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
    if not connecting.done():
        connecting.cancel()
        raise BusRefused(f"{name} could not log in to NATS at {url}: {refused.result()}")
    nc = connecting.result()
    log.info("%s connected to NATS at %s", name, url)
    return nc


# How long a drain of the bus, then a close, may take at shutdown.
DRAIN_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 2.0
# How long a whole shutdown may take before the process ends without finishing it, and
# what is left of it once the bus is closed (or would not close).
SHUTDOWN_LIMIT_S = 30.0
AFTER_CLOSE_S = 5.0


async def close_for_exit(nc: Client) -> None:
    """A service process's last use of the bus: drain it; a bus that is already gone
    (stopped first, or restarting) is no error at shutdown, and no traceback.

    Bounded: a drain while every node is going away (a whole `llmbus serve` killed at
    once) can wait on reconnection forever, and nats-py's drain swallows a cancellation,
    so one that overruns is left behind. Even a closed client may leave its reconnection
    task behind (it can outlive a cancellation), which asyncio.run would wait for at exit:
    so what is left of the process's shutdown gets a few seconds from here, and then it
    ends (`exit_if_stuck`). Only for a process on its way out."""
    for attempt, timeout_s in ((nc.drain, DRAIN_TIMEOUT_S), (nc.close, CLOSE_TIMEOUT_S)):
        task = asyncio.ensure_future(attempt())
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            log.debug("NATS %s at shutdown: not done in %.0f s", attempt.__name__, timeout_s)
        elif task.cancelled() or task.exception() is not None:  # nats-py raises several kinds here
            log.debug("NATS %s at shutdown: %s", attempt.__name__, "cancelled" if task.cancelled() else
                      f"{type(task.exception()).__name__}: {task.exception()}")
        else:
            break
    exit_if_stuck(AFTER_CLOSE_S)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT/SIGTERM, so a service can drain and exit cleanly; the first
    signal also sets a limit on the shutdown (`exit_if_stuck`)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if not stop.is_set():
            exit_if_stuck()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    return stop


def exit_if_stuck(limit_s: float = SHUTDOWN_LIMIT_S) -> None:
    """From now, a shutdown that has not ended within `limit_s` ends the process. nats-py's
    reconnection to a bus that is gone can outlive its cancellation (Python 3.11's
    wait_for may swallow it), and asyncio.run waits for every task at exit: a service
    whose parent and NATS nodes were killed together was seen still running 15 min on."""

    def give_up() -> None:
        log.warning("shutdown did not finish within %.0f s; exiting without it", limit_s)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(limit_s, give_up)
    timer.daemon = True  # (a shutdown that finishes does not wait for it)
    timer.start()
