"""A streamed answer's response: its events go straight to the server's `send`.

Starlette's StreamingResponse hands every event through each middleware's `send` wrapper
(the error handlers', CORS's, the HTTP metrics', the request-id header's: six calls a
token) and runs the stream in a task group beside a disconnect listener. None of those
wrappers looks at a body after the response has started: each acts on
`http.response.start` only. So the start and the end of a stream go through them, as any
response's do, and the events between go to the server's own `send` (uvicorn's, which
keeps its flow control: a client that stops reading pauses the writes), which `GatewayApp`
keeps in the scope. A client that leaves cancels the stream: the events' generator
closes, and its cleanup aborts the engine's requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import Response

RAW_SEND = "llmbus.send"  # (the scope's key for the server's own send)


class GatewayApp(FastAPI):
    """FastAPI, keeping the server's `send` in each HTTP request's scope for EventStream."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        # The events in a task of their own: each token resumes that task's few frames, not
        # the request task's whole chain of middlewares and routing (~15 frames a token).
        loop = asyncio.get_running_loop()
        pump = loop.create_task(self._pump(scope.get(RAW_SEND, send)))
        listener = loop.create_task(_client_left(receive))
        try:
            await asyncio.wait((pump, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not pump.done():  # the client left (or the server stops): the events close now
                pump.cancel()
                await asyncio.wait((pump,))
            listener.cancel()
        if not pump.cancelled():
            pump.result()  # (raises what the events raised)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, write) -> None:
        try:
            async for event in self.events:
                await write({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            await self.events.aclose()  # (its cleanup aborts the engine's requests of a client that left)


async def _client_left(receive) -> None:
    """Returns when the client leaves (the request's body was read: what comes now is its end)."""
    while (await receive())["type"] != "http.disconnect":
        pass
