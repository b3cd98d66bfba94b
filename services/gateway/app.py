"""The OpenAI-compatible HTTP front: FastAPI routes over an `EngineClient`.

Input is validated here, before anything reaches the engine; every error has OpenAI's
shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from starlette.datastructures import Headers

from services.gateway.engine_client import BadRequest, EngineClient, Overloaded, Unavailable
from services.gateway.generation import ChoiceDelta, EngineError, Usage, generate
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompt,
    parse_body,
    to_sampling_params,
    validate_messages,
)
from shared.messages import TokenizeRequest
from shared.tracing import SpanKind, inject

request_log = logging.getLogger("llmbus.requests")

_json_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    idle_timeout_s: float = 300.0


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status)


class _Limits:
    """API key and body size, checked before a route reads anything.

    A plain ASGI middleware: it looks at the request's headers and then either answers
    itself or hands the untouched scope, receive and send on. Starlette's
    BaseHTTPMiddleware instead pipes every response body through a memory stream, and
    for SSE that was most of the gateway's CPU: 58% of its samples at 128 streams
    (py-spy), one stream hand-off, event and task switch per chunk."""

    def __init__(self, app, config: GatewayConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            error = self._check(Headers(scope=scope))
            if error is not None:
                await error(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, headers: Headers) -> JSONResponse | None:
        key = self.config.api_key
        if key and headers.get("authorization", "") != f"Bearer {key}":
            return error_response(401, "invalid or missing API key", "authentication_error")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            return error_response(
                413, f"request body is {length} bytes; the limit is {self.config.max_body_bytes}",
                "invalid_request_error",
            )
        return None


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, BadRequest):
        return 400
    if isinstance(exc, Overloaded):
        return 429
    if isinstance(exc, Unavailable):
        return 503
    return 500


def _end_span(span, status: int, exc: BaseException | None = None) -> None:
    span.set_attribute("http.response.status_code", status)
    if exc is not None:
        span.record_exception(exc)
    if status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()


async def _prepend(first, stream):
    try:
        if first:
            yield first
        async for item in stream:
            yield item
    finally:
        await stream.aclose()  # a client that left must abort the engine request now


def create_app(client_factory, tokenizer, config: GatewayConfig, tracer=None) -> FastAPI:
    """`client_factory(on_stats)` is awaited at startup and returns a started EngineClient."""
    from contextlib import asynccontextmanager

    state: dict = {}
    tracer = tracer or trace.get_tracer("llmbus.gateway")
    metrics = GatewayMetrics(config.model_name)

    @asynccontextmanager
    async def lifespan(_app):
        state["client"] = await client_factory(metrics.observe_stats)
        yield
        close = getattr(state["client"], "aclose", None)
        if close is not None:
            await close()

    app = FastAPI(title="llmbus", lifespan=lifespan)
    app.add_middleware(_Limits, config=config)

    def client() -> EngineClient:
        return state["client"]

    @app.exception_handler(BadRequest)
    async def _bad_request(_req, exc: BadRequest):
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(Unavailable)
    async def _unavailable(_req, exc: Unavailable):
        return error_response(503, str(exc), "service_unavailable")

    @app.exception_handler(Overloaded)
    async def _overloaded(_req, exc: Overloaded):
        response = error_response(429, str(exc), "rate_limit_exceeded")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(EngineError)
    async def _engine_error(_req, exc: EngineError):
        return error_response(500, str(exc), "internal_error")

    @app.get("/health")
    async def health():
        try:
            info = await client().scheduler_info(max_age_s=0.0)
        except Unavailable as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        if info.num_workers < 1:
            return JSONResponse({"status": "unavailable", "reason": "no worker has joined"}, status_code=503)
        stats = info.stats
        return {
            "status": "ok",
            "model": config.model_name,
            "workers": info.num_workers,
            "max_model_len": info.max_model_len,
            "stats": None if stats is None else {
                "num_running_reqs": stats.num_running_reqs,
                "num_waiting_reqs": stats.num_waiting_reqs,
                "kv_cache_usage": stats.kv_cache_usage,
                "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "num_preemptions": stats.num_preemptions,
                "num_generation_tokens": stats.num_generation_tokens,
            },
        }

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "llmbus"}],
        }

    async def read_body(request: Request) -> bytes:
        body = b""
        async for chunk in request.stream():  # also bounds bodies sent without a length
            body += chunk
            if len(body) > config.max_body_bytes:
                raise _TooLarge()
        return body

    class _TooLarge(Exception):
        pass

    @app.exception_handler(_TooLarge)
    async def _too_large(_req, _exc):
        return error_response(413, f"request body exceeds {config.max_body_bytes} bytes", "invalid_request_error")

    async def tokenize(request: TokenizeRequest, ctx) -> list[int]:
        with tracer.start_as_current_span("gateway.tokenize", context=ctx, kind=SpanKind.CLIENT) as span:
            ids = await client().tokenize(request, headers=inject())
            span.set_attribute("llmbus.num_tokens", len(ids))
            return ids

    async def prepare(request: Request, kind, ctx):
        if client().scheduler_silent():
            raise Unavailable("the scheduler is not running")
        body = parse_body(await read_body(request), kind)
        if body.model != config.model_name:
            return body, None, None, error_response(
                404, f"the model `{body.model}` does not exist; this server serves `{config.model_name}`",
                "invalid_request_error", "model", "model_not_found",
            )
        params = to_sampling_params(body)
        if isinstance(body, ChatCompletionRequest):
            validate_messages(body.messages)
            token_ids = await tokenize(
                TokenizeRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt), ctx
            )
        else:
            prompt = completion_prompt(body)
            if isinstance(prompt, str):
                token_ids = await tokenize(TokenizeRequest(prompt=prompt), ctx)
            else:
                token_ids = prompt
                bad = [t for t in token_ids if not 0 <= t < tokenizer.backend.get_vocab_size(True)]
                if bad:
                    raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary", "prompt")
        info = await client().scheduler_info()
        if info.num_workers < 1:
            # No worker yet (still loading the model) or none left: the context is not known
            # here. The scheduler holds the request until a worker joins, checks its length
            # then, and answers with a clear error if none joins in time.
            return body, params, token_ids, None
        context = info.max_model_len
        max_tokens = params.max_tokens
        if max_tokens is not None and len(token_ids) + max_tokens > context:
            raise BadRequest(
                f"this model's context is {context} tokens, but the prompt has {len(token_ids)} tokens "
                f"and max_tokens asks for {max_tokens} more ({len(token_ids) + max_tokens} in all)",
                "max_tokens",
            )
        if len(token_ids) >= context:
            raise BadRequest(
                f"this model's context is {context} tokens, but the prompt has {len(token_ids)} tokens",
                "prompt",
            )
        return body, params, token_ids, None

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, CompletionRequest, "cmpl", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, ChatCompletionRequest, "chatcmpl", chat=True)

    async def handle(request: Request, kind, prefix: str, chat: bool):
        """FastAPI opens the HTTP server span; this one, inside it, lasts until the last byte
        of a stream and parents everything the request causes on the bus."""
        path = request.url.path
        span = tracer.start_span(
            "gateway.request", kind=SpanKind.INTERNAL,
            attributes={"http.request.method": "POST", "url.path": path, "http.route": path},
        )
        ctx = trace.set_span_in_context(span)
        try:
            body, params, token_ids, error = await prepare(request, kind, ctx)
        except Exception as exc:
            _end_span(span, 413 if isinstance(exc, _TooLarge) else _status_of(exc), exc)
            raise
        if error is not None:
            _end_span(span, error.status_code)
            return error
        return await serve_request(request, prefix, body, params, token_ids, chat, span, ctx)

    async def serve_request(request: Request, prefix: str, body, params, token_ids, chat: bool, span, ctx):
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        usage = Usage()
        stream_span = tracer.start_span("gateway.stream", context=ctx)
        stream = generate(
            client(), tokenizer.backend, request_id, token_ids, params, tokenizer.eos_token_id,
            usage, config.idle_timeout_s, trace_headers=inject(ctx),
        )

        def finished(status: int, exc: BaseException | None = None) -> None:
            stream_span.set_attribute("llmbus.completion_tokens", usage.completion_tokens)
            stream_span.end()
            _end_span(span, status, exc)
            e2e = time.monotonic() - usage.started_at
            if status == 200 and usage.finish_reasons:
                metrics.request_finished(usage.prompt_tokens, usage.completion_tokens, usage.finish_reasons,
                                         usage.ttft, usage.itls, e2e, usage.queue_time_s)
            request_log.info("request finished", extra={
                "request_id": request_id, "status": status, "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens, "cached_tokens": usage.cached_tokens,
                "ttft_s": None if usage.ttft is None else round(usage.ttft, 4), "e2e_s": round(e2e, 4),
                "finish_reason": ",".join(usage.finish_reasons) or None,
            })

        echo = ""
        if not chat and body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(token_ids, skip_special_tokens=False)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # Wait for the engine's first answer before sending headers, so a request it
            # refuses (full queue, bad input) gets a real HTTP status, not an SSE error.
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                first = []
            except Exception as exc:
                finished(_status_of(exc), exc)
                raise
            return StreamingResponse(
                sse(_prepend(first, stream), request_id, created, chat, include_usage, usage, echo, params.n, finished),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            response = await collect(request, stream, request_id, created, chat, usage, echo, params.n)
        except Exception as exc:
            finished(_status_of(exc), exc)
            raise
        finished(response.status_code if isinstance(response, Response) else 200)
        return response

    async def collect(request, stream, request_id, created, chat, usage, echo, n):
        texts = [echo] * n
        finish = [None] * n
        logprobs: list[list] = [[] for _ in range(n)]
        want_logprobs = False

        async def consume():
            nonlocal want_logprobs
            async for deltas in stream:
                for d in deltas:
                    texts[d.index] += d.text
                    logprobs[d.index].extend(d.logprobs)
                    want_logprobs |= bool(d.logprobs)
                    if d.finish_reason is not None:
                        finish[d.index] = d.finish_reason

        async def watch_disconnect():
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(watch_disconnect())
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer not in done:
            consumer.cancel()  # the client left: the generator's cleanup aborts in the engine
            await stream.aclose()
            return JSONResponse({}, status_code=499)
        watcher.cancel()
        consumer.result()
        choices = []
        for i in range(n):
            choice = {"index": i, "finish_reason": finish[i]}
            if chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
                choice["logprobs"] = chat_logprobs(logprobs[i]) if want_logprobs else None
            else:
                choice["text"] = texts[i]
                choice["logprobs"] = completion_logprobs(logprobs[i]) if want_logprobs else None
            choices.append(choice)
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": config.model_name,
            "choices": choices,
            "usage": usage.as_dict(),
        }

    async def sse(stream: AsyncIterator[list[ChoiceDelta]], request_id, created, chat, include_usage, usage, echo, n,
                  finished):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, with_usage=None) -> str:
            payload = {"id": request_id, "object": kind, "created": created, "model": config.model_name, "choices": choices}
            if include_usage:
                payload["usage"] = with_usage
            # msgspec: UTF-8 unescaped like json.dumps(ensure_ascii=False), at a fraction of
            # its cost per chunk (one chunk per token per stream at 128 streams).
            return b"data: " + _json_encode(payload) + b"\n\n"

        status, failure = 499, None  # a client that leaves mid-stream never sees the end
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(n)])
            elif echo:
                yield chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None} for i in range(n)])
            async for deltas in stream:
                out = []
                for d in deltas:
                    if not d.text and d.finish_reason is None and not d.logprobs:
                        continue  # bytes of a character still incomplete: nothing to show yet
                    if chat:
                        choice = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                                  "logprobs": chat_logprobs(d.logprobs) if d.logprobs else None,
                                  "finish_reason": d.finish_reason}
                    else:
                        choice = {"index": d.index, "text": d.text,
                                  "logprobs": completion_logprobs(d.logprobs) if d.logprobs else None,
                                  "finish_reason": d.finish_reason}
                    out.append(choice)
                if out:
                    yield chunk(out)
            if include_usage:
                yield chunk([], usage.as_dict())
            status = 200
        except (EngineError, Unavailable, BadRequest, Overloaded) as exc:
            status, failure = _status_of(exc), exc
            kind = "invalid_request_error" if status == 400 else "internal_error"
            error = {"message": str(exc), "type": kind, "param": getattr(exc, "param", None), "code": status}
            yield f"data: {json.dumps({'error': error})}\n\n"
        finally:
            finished(status, failure)
        yield "data: [DONE]\n\n"

    def token_text(token_id: int) -> str:
        return tokenizer.backend.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(items) -> dict:
        return {
            "tokens": [token_text(lp.token_ids[0]) for lp in items],
            "token_logprobs": [lp.logprobs[0] for lp in items],
            "top_logprobs": [
                {token_text(t): v for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])} for lp in items
            ],
            "text_offset": [],
        }

    def chat_logprobs(items) -> dict:
        def entry(token_id, value):
            text = token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(lp.token_ids[0], lp.logprobs[0]),
                 "top_logprobs": [entry(t, v) for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])]}
                for lp in items
            ]
        }

    return app
