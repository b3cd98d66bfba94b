"""The gateway service: NATS connection + EngineClient + the FastAPI app on uvicorn."""

from __future__ import annotations

import logging
import os
import socket
import uuid

import uvicorn

from services.gateway.app import create_app
from services.gateway.serving import OpenAIServing
from services.gateway.shell.engine_client import EngineClient
from services.gateway.shell.peers import GatewayPeers
from services.gateway.shell.response_peers import ResponsePeers
from services.gateway.shell.sibling_metrics import SiblingMetrics
from services.tokenizer.tokenizer import Tokenizer
from shared.bus import BusAuth, Subjects, close_for_exit, connect, exit_if_stuck
from shared.config import GatewayConfig
from shared.gc_heap import freeze_heap
from shared.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger("llmbus.gateway")


def build_app(tokenizer_path: str, nats_url: str, config: GatewayConfig, timeout_s: float = 10.0,
              auth: BusAuth | None = None, gateway_id: str | None = None):
    # For detokenizing outputs and /tokenizer_info; encoding is the tokenizers' job.
    tokenizer = Tokenizer(tokenizer_path, chat_template=config.chat_template)
    gateway_id = gateway_id or uuid.uuid4().hex[:8]

    async def client_factory(on_stats) -> EngineClient:
        holder: list[EngineClient] = []

        async def on_reconnect() -> None:
            if holder:
                await holder[0].on_reconnect()

        nc = await connect(nats_url, f"gateway-{gateway_id}", on_reconnect, auth)
        client = EngineClient(nc, Subjects(config.model_name), gateway_id, timeout_s, on_stats,
                              resume_timeout_s=config.scheduler_resume_timeout_s, group=config.api_server_group)
        holder.append(client)
        await client.start()

        async def aclose():
            await close_for_exit(nc)

        client.aclose = aclose  # type: ignore[attr-defined]
        return client

    return create_app(client_factory, tokenizer, config, setup_tracing("gateway"), join_peers)


async def join_peers(serving: OpenAIServing, client: EngineClient) -> None:
    """The deployment's other gateways: stored responses found and dropped at any of them,
    and /metrics merged across the gateways of one port."""
    peers = GatewayPeers(client.nc, client.subjects, client.reply_subject, client.group)
    await peers.start()
    serving.responses = ResponsePeers(serving.responses.store)
    await serving.responses.start(peers)
    serving.port_metrics = SiblingMetrics(serving.metrics)
    await serving.port_metrics.start(peers)


def serve(tokenizer_path: str, nats_url: str, config: GatewayConfig, host: str, port: int,
          auth: BusAuth | None = None, gateway_id: str | None = None, uvicorn_log_level: str = "warning",
          https: dict | None = None, fd: int | None = None, access_log: bool = True) -> None:
    """`https`: uvicorn's ssl_certfile and ssl_keyfile, to serve HTTPS (vLLM's flags); `fd`: an
    inherited listening socket to serve on instead of binding host:port (llmbus serve's)."""
    app = build_app(tokenizer_path, nats_url, config, auth=auth, gateway_id=gateway_id)
    sockets = None if fd is None else [socket.socket(fileno=fd)]  # (its family and type read from it)
    log.info("gateway on %s://%s:%d", "https" if https else "http", *(sockets[0].getsockname()[:2] if sockets
                                                                        else (host, port)))
    # uvicorn handles SIGINT/SIGTERM itself: it stops accepting, finishes, runs the lifespan exit.
    # Its access log (a line per HTTP request) only where its level asks for INFO, as vLLM's.
    # log_config=None: its records go through our JSON lines on stderr, as every other log
    # (its own config would print plain text, the access log on stdout beside the banner).
    access_log = access_log and uvicorn_log_level in ("info", "debug", "trace")
    _Server(uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level, access_log=access_log,
                           log_config=None, root_path=config.root_path, **(https or {}))).run(sockets=sockets)
    shutdown_tracing()


class _Server(uvicorn.Server):
    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # (not where it could not bind its port: it is exiting)
            freeze_heap("gateway")

    def handle_exit(self, sig, frame) -> None:
        if not self.started:
            # Still starting: uvicorn waits for the lifespan's start-up whatever the signal,
            # and ours may wait on a NATS it cannot reach for good (a cancelled start-up is
            # logged by uvicorn with a traceback). Nothing is served or held yet: go now,
            # with the exit status of a process the signal ended.
            log.info("gateway stopped while starting")
            logging.shutdown()
            os._exit(128 + sig)
        if not self.should_exit:  # the first signal: the shutdown it starts is bounded too
            exit_if_stuck()
        super().handle_exit(sig, frame)
