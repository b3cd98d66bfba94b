"""The tokenizer service: chat templates and encoding, request/reply in a queue group.

Replicas subscribe with the same queue group, so NATS spreads requests among them.
A bad input (a template that fails, a malformed message) is answered with an error,
never left to time out.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from services.tokenizer.tokenizer import Tokenizer
from shared.bus import Subjects, close, connect, encode, stop_on_signals
from shared.messages import TokenizeRequest, TokenizeResponse
from shared.tracing import SpanKind, extract, setup_tracing, shutdown_tracing

log = logging.getLogger("llmbus.tokenizer")
QUEUE_GROUP = "tokenizers"


def tokenize(tokenizer: Tokenizer, request: TokenizeRequest) -> TokenizeResponse:
    if (request.prompt is None) == (request.messages is None):
        return TokenizeResponse(error="give exactly one of prompt and messages")
    try:
        if request.messages is not None:
            ids = tokenizer.apply_chat_template(request.messages, request.add_generation_prompt)
        else:
            ids = tokenizer.encode(request.prompt, request.add_special_tokens)
    except ValueError as exc:
        return TokenizeResponse(error=str(exc))
    return TokenizeResponse(token_ids=ids)


async def serve(model_path: str, nats_url: str, model_name: str, ready: asyncio.Event | None = None) -> None:
    tokenizer = Tokenizer(model_path)
    tracer = setup_tracing("tokenizer")
    subjects = Subjects(model_name)
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    nc = await connect(nats_url, "tokenizer")

    async def handle(msg) -> None:
        with tracer.start_as_current_span("tokenizer.encode", context=extract(msg.headers), kind=SpanKind.SERVER) as span:
            response = _handle(msg.data)
            span.set_attribute("llmbus.num_tokens", len(response.token_ids))
            if response.error:
                span.set_attribute("llmbus.error", response.error)
        await msg.respond(encode(response))

    def _handle(data: bytes) -> TokenizeResponse:
        try:
            return tokenize(tokenizer, decoder.decode(data))
        except msgspec.DecodeError as exc:
            return TokenizeResponse(error=f"malformed tokenize request: {exc}")
        except Exception as exc:  # noqa: BLE001 - a handler must never kill the subscription
            log.exception("tokenize failed")
            return TokenizeResponse(error=f"tokenizer failed: {type(exc).__name__}: {exc}")

    await nc.subscribe(subjects.tokenize, queue=QUEUE_GROUP, cb=handle)
    await nc.flush()
    stop = stop_on_signals()
    log.info("tokenizer ready on %s", subjects.tokenize)
    if ready is not None:
        ready.set()
    await stop.wait()
    await close(nc)
    shutdown_tracing()
