"""A client's own request id, as vLLM takes it: the `X-Request-Id` header, else the body's
`request_id`, names the response (`chatcmpl-<id>`), so a proxy's or client's id finds its
answer in the response and in the gateway's request log. The engine's id stays one of
ours: two requests sent with the same id (a retry, a careless client) must not share one
in the scheduler. With `--enable-request-id-headers` every response carries
`X-Request-Id` back: the one sent, or one made up.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders

from services.gateway.errors import BadRequest

MAX_LENGTH = 256  # an id is for logs and correlation, not a payload


def client_request_id(headers: Headers, body_request_id: str | None) -> str | None:
    """The id the client gave (the header first, as vLLM), or None."""
    given, field = headers.get("x-request-id"), "X-Request-Id"
    if not given:
        given, field = body_request_id, "request_id"
    if given is not None and not 0 < len(given) <= MAX_LENGTH:
        raise BadRequest(f"{field} must be 1 to {MAX_LENGTH} characters", field)
    return given


def request_names(prefix: str, headers: Headers, body_request_id: str | None) -> tuple[str, str | None, str]:
    """(the engine's request id, new and unique whatever a client sends; the client's id or
    None; the response's id, `prefix` and the client's where it gave one)."""
    engine_id = f"{prefix}{uuid.uuid4().hex}"
    client_id = client_request_id(headers, body_request_id)
    return engine_id, client_id, engine_id if client_id is None else f"{prefix}{client_id}"


class RequestIdHeader:
    """A plain ASGI middleware (limits.py says why not Starlette's): X-Request-Id on every
    response, the request's or a new one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, with_id)
