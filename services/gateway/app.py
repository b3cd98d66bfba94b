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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.middleware.base import BaseHTTPMiddleware

from services.gateway.engine_client import BadRequest, EngineClient, Unavailable
from services.gateway.generation import ChoiceDelta, EngineError, Usage, generate
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompt,
    parse_body,
    to_sampling_params,
    validate_messages,
)
from shared.messages import TokenizeRequest


@dataclass(slots=True)
class GatewayConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    idle_timeout_s: float = 300.0


def error_response(status: int, message: str, type_: str, param: str | None = None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status)


class _Limits(BaseHTTPMiddleware):
    """API key and body size, checked before a route reads anything."""

    def __init__(self, app, config: GatewayConfig) -> None:
        super().__init__(app)
        self.config = config

    async def dispatch(self, request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            key = self.config.api_key
            if key and request.headers.get("authorization", "") != f"Bearer {key}":
                return error_response(401, "invalid or missing API key", "authentication_error")
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
                return error_response(
                    413, f"request body is {length} bytes; the limit is {self.config.max_body_bytes}",
                    "invalid_request_error",
                )
        return await call_next(request)


def create_app(client_factory, tokenizer, config: GatewayConfig) -> FastAPI:
    """`client_factory` is awaited at startup and returns a started EngineClient."""
    from contextlib import asynccontextmanager

    state: dict = {}

    @asynccontextmanager
    async def lifespan(_app):
        state["client"] = await client_factory()
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

    async def prepare(request: Request, kind):
        body = parse_body(await read_body(request), kind)
        if body.model != config.model_name:
            return body, None, None, error_response(
                404, f"the model `{body.model}` does not exist; this server serves `{config.model_name}`",
                "invalid_request_error", "model", "model_not_found",
            )
        params = to_sampling_params(body)
        if isinstance(body, ChatCompletionRequest):
            validate_messages(body.messages)
            token_ids = await client().tokenize(
                TokenizeRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            )
        else:
            prompt = completion_prompt(body)
            if isinstance(prompt, str):
                token_ids = await client().tokenize(TokenizeRequest(prompt=prompt))
            else:
                token_ids = prompt
                bad = [t for t in token_ids if not 0 <= t < tokenizer.backend.get_vocab_size(True)]
                if bad:
                    raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary", "prompt")
        info = await client().scheduler_info()
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
        body, params, token_ids, error = await prepare(request, CompletionRequest)
        if error is not None:
            return error
        return await serve_request(request, "cmpl", body, params, token_ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, params, token_ids, error = await prepare(request, ChatCompletionRequest)
        if error is not None:
            return error
        return await serve_request(request, "chatcmpl", body, params, token_ids, chat=True)

    async def serve_request(request: Request, prefix: str, body, params, token_ids, chat: bool):
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        usage = Usage()
        stream = generate(
            client(), tokenizer.backend, request_id, token_ids, params, tokenizer.eos_token_id,
            usage, config.idle_timeout_s,
        )
        echo = ""
        if not chat and body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(token_ids, skip_special_tokens=False)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                sse(stream, request_id, created, chat, include_usage, usage, echo, params.n),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await collect(request, stream, request_id, created, chat, usage, echo, params.n)

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

    async def sse(stream: AsyncIterator[list[ChoiceDelta]], request_id, created, chat, include_usage, usage, echo, n):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, with_usage=None) -> str:
            payload = {"id": request_id, "object": kind, "created": created, "model": config.model_name, "choices": choices}
            if include_usage:
                payload["usage"] = with_usage
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

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
        except (EngineError, Unavailable, BadRequest) as exc:
            status, kind = (400, "invalid_request_error") if isinstance(exc, BadRequest) else (500, "internal_error")
            error = {"message": str(exc), "type": kind, "param": getattr(exc, "param", None), "code": status}
            yield f"data: {json.dumps({'error': error})}\n\n"
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
