"""What every answer of the gateway writes with: JSON bodies, server-sent events that any
line reader splits right, the request span's end, and the request log."""

from __future__ import annotations

import logging

import msgspec
from opentelemetry import trace

request_log = logging.getLogger("llmbus.requests")

JSON = msgspec.json.Encoder()


# U+0085, U+2028 and U+2029 may stand unescaped in JSON, and msgspec leaves them so; but
# Python's str.splitlines() ends a line at each, and SSE clients that read lines with it
# (httpx's aiter_lines, and httpx-sse over it) cut an event in two where a token's text
# holds one, then fail on half a JSON object. Escaped, an event is one line to any reader.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_event(data: bytes, event: str | None = None) -> bytes:
    """One server-sent event whose data is this JSON."""
    if b"\xc2\x85" in data or b"\xe2\x80" in data:  # (most text holds none: one scan for both leads)
        for raw, escaped in _LINE_BREAKS:
            if raw in data:  # (UTF-8: these bytes are that character and nothing else)
                data = data.replace(raw, escaped)
    return (f"event: {event}\n".encode() if event else b"") + b"data: " + data + b"\n\n"


def end_span(span, status: int, exc: BaseException | None = None) -> None:
    span.set_attribute("http.response.status_code", status)
    if exc is not None:
        span.record_exception(exc)
    if status >= 500:
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()
