"""The tokenizer service: chat templates and encoding, request/reply in a queue group.

Replicas subscribe with the same queue group, so NATS spreads requests among them.
A bad input (a template that fails, a malformed message) is answered with an error,
never left to time out.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from services.tokenizer.grammar_check import GrammarChecker
from services.tokenizer.tokenizer import Tokenizer
from shared.bus import BusAuth, Subjects, close_for_exit, connect, encode, stop_on_signals
from shared.messages import TokenizeRequest, TokenizeResponse
from shared.sampling_params import StructuredOutputsParams
from shared.tracing import SpanKind, extract, setup_tracing, shutdown_tracing

log = logging.getLogger("llmbus.tokenizer")
QUEUE_GROUP = "tokenizers"


def tokenize(tokenizer: Tokenizer, request: TokenizeRequest) -> TokenizeResponse:
    if request.prompt is None and request.messages is None:
        if request.structured_outputs is not None:
            return TokenizeResponse()  # a check of the spec alone
        return TokenizeResponse(error="give exactly one of prompt and messages")
    if request.prompt is not None and request.messages is not None:
        return TokenizeResponse(error="give exactly one of prompt and messages")
    if request.images and request.messages is None:
        return TokenizeResponse(error="images come in a chat's messages, as image parts")
    features = []
    try:
        if request.images:  # (the template renders each image part as the model marks an image)
            text = tokenizer.render_chat(request.messages, request.add_generation_prompt, request.tools,
                                         request.continue_final_message, request.chat_template_kwargs,
                                         documents=request.documents)
            ids, features = tokenizer.encode_with_images(text, request.images, add_special_tokens=False)
        elif request.messages is not None:
            ids = tokenizer.apply_chat_template(request.messages, request.add_generation_prompt, request.tools,
                                                request.continue_final_message, request.chat_template_kwargs,
                                                documents=request.documents)
        else:
            ids = tokenizer.encode(request.prompt, request.add_special_tokens)
    except ValueError as exc:
        return TokenizeResponse(error=str(exc))
    return TokenizeResponse(token_ids=ids, mm_features=features)


async def serve(tokenizer_path: str, nats_url: str, model_name: str, ready: asyncio.Event | None = None,
                compile_timeout_s: float = 5.0, tool_chat_template: str | None = None,
                chat_template: str | None = None, auth: BusAuth | None = None, content_format: str = "auto") -> None:
    """`tokenizer_path`: the folder the tokenizer is read from (the model's, or --tokenizer's);
    `content_format`: --chat-template-content-format."""
    tokenizer = Tokenizer(tokenizer_path, tool_chat_template, chat_template, content_format)
    # Started at the first spec (a child process with the vocabulary), not by every replica.
    grammars = GrammarChecker(tokenizer_path, compile_timeout_s)
    loop = asyncio.get_running_loop()
    tracer = setup_tracing("tokenizer")
    subjects = Subjects(model_name)
    decoder = msgspec.msgpack.Decoder(TokenizeRequest)
    nc = await connect(nats_url, "tokenizer", auth=auth)

    checking: set[asyncio.Task] = set()

    async def handle(msg) -> None:
        # nats-py awaits a subscription's callbacks one at a time, so a request whose spec
        # must compile is answered from a task of its own: the requests behind it are
        # tokenized meanwhile instead of waiting out its compile (up to the timeout).
        span = tracer.start_span("tokenizer.encode", context=extract(msg.headers), kind=SpanKind.SERVER)
        response, spec = _handle(msg.data)
        if spec is not None and response.error is None:
            task = asyncio.create_task(check_then_answer(msg, span, response, spec))
            checking.add(task)
            task.add_done_callback(checking.discard)
        else:
            await answer(msg, span, response)

    async def check_then_answer(msg, span, response: TokenizeResponse, spec: StructuredOutputsParams) -> None:
        # In a thread: the check waits on the compiling child, off the event loop.
        response.error = await loop.run_in_executor(None, grammars.check, spec)
        await answer(msg, span, response)

    async def answer(msg, span, response: TokenizeResponse) -> None:
        with span:
            span.set_attribute("llmbus.num_tokens", len(response.token_ids))
            if response.error:
                span.set_attribute("llmbus.error", response.error)
        await msg.respond(encode(response))

    def _handle(data: bytes) -> tuple[TokenizeResponse, StructuredOutputsParams | None]:
        try:
            request = decoder.decode(data)
            return tokenize(tokenizer, request), request.structured_outputs
        except msgspec.DecodeError as exc:
            return TokenizeResponse(error=f"malformed tokenize request: {exc}"), None
        except Exception as exc:  # noqa: BLE001 - a handler must never kill the subscription
            log.exception("tokenize failed")
            return TokenizeResponse(error=f"tokenizer failed: {type(exc).__name__}: {exc}"), None

    # The compiling child starts beside serving: the first request with a spec would
    # otherwise wait for its vocabulary to load.
    warming = loop.run_in_executor(None, grammars.warm_up)
    await nc.subscribe(subjects.tokenize, queue=QUEUE_GROUP, cb=handle)
    await nc.flush()
    stop = stop_on_signals()
    log.info("tokenizer ready on %s", subjects.tokenize)
    if ready is not None:
        ready.set()
    await stop.wait()
    if checking:  # answer the checks under way (each ends within the compile timeout)
        await asyncio.wait(checking, timeout=compile_timeout_s + 1)
    await close_for_exit(nc)
    grammars.close()  # (a warm-up still under way ends with it)
    await warming
    shutdown_tracing()
