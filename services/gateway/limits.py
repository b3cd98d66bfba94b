"""API key and body size, checked before a route reads anything.

A plain ASGI middleware: it looks at the request's headers and then either answers
itself or hands the untouched scope, receive and send on. Starlette's
BaseHTTPMiddleware instead pipes every response body through a memory stream, and for
SSE that was most of the gateway's CPU: 58% of its samples at 128 streams (py-spy), one
stream hand-off, event and task switch per chunk.
"""

from __future__ import annotations

from starlette.datastructures import Headers

from services.gateway.api_keys import ApiKeys
from services.gateway.errors import GatewayError, TooLarge, Unauthorized, error_response
from shared.config import GatewayConfig


class Limits:
    def __init__(self, app, config: GatewayConfig, keys: ApiKeys) -> None:
        self.app = app
        self.config = config
        self.keys = keys
        # /tokenize and /detokenize do work for the caller too (vLLM leaves them open), as do
        # /score, /rerank and /classify (vLLM's paths outside /v1 too).
        guarded = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/tokenizer_info", "/score", "/rerank", "/classify")
        self._guarded = (*guarded, "/metrics") if config.metrics_require_key else guarded

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _route_path(scope).startswith(self._guarded):
            error = self._check(Headers(scope=scope))
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, headers: Headers) -> GatewayError | None:
        if self.keys.required and not self.keys.accepts(headers.get("authorization", "")):
            return Unauthorized("invalid or missing API key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            return TooLarge(f"request body is {length} bytes; the limit is {self.config.max_body_bytes}")
        return None


def _route_path(scope) -> str:
    """The path the routes see: behind --root-path (uvicorn's), a request may still come
    with that prefix (sent to the gateway directly, past the proxy); the router strips it,
    so the check must too, or /api/v1/... would reach /v1/... without its key."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
