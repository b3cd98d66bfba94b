"""Every error the gateway answers, and the one mapping from error to HTTP status and
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`, used alike by
the route handlers, the exception handlers and a stream that fails after its headers."""

from __future__ import annotations

import msgspec
from fastapi.responses import Response

from shared.messages import FinishReason
from shared.processing.output_processor import ChoiceDelta


# The status a request is logged (and, non-streamed, answered) with when its client left
# before its end (nginx's "client closed request"; nobody reads the answer).
CLIENT_LEFT = 499


class GatewayError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class BadRequest(GatewayError, ValueError):
    """The client's input is wrong."""

    status, type = 400, "invalid_request_error"


class NotFound(GatewayError):
    status, type = 404, "invalid_request_error"


class NoRoute(GatewayError):
    """A path or method the gateway does not serve (routing's 404 or 405, in OpenAI's shape)."""

    type = "invalid_request_error"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ClientLeft(GatewayError):
    """The client went before its request was read whole: nobody to answer, nothing to log
    but its line."""

    status, type = CLIENT_LEFT, "client_closed_request"


class TooLarge(GatewayError):
    status, type = 413, "invalid_request_error"


class Overloaded(GatewayError):
    """The engine's waiting queue is full: to be retried later."""

    status, type = 429, "rate_limit_exceeded"


class EngineError(GatewayError, RuntimeError):
    """The engine failed the request (its message says why)."""


class Unavailable(GatewayError, RuntimeError):
    """A service the request needs does not answer."""

    status, type = 503, "service_unavailable"


class Unauthorized(GatewayError):
    status, type = 401, "authentication_error"


class _ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int | str


class _ErrorBody(msgspec.Struct):
    error: _ErrorInfo


def status_of(exc: BaseException) -> int:
    return exc.status if isinstance(exc, GatewayError) else 500


def error_body(exc: BaseException) -> bytes:
    if not isinstance(exc, GatewayError):
        exc = EngineError(f"{type(exc).__name__}: {exc}")
    code = exc.code if exc.code is not None else exc.status
    return msgspec.json.encode(_ErrorBody(_ErrorInfo(str(exc), exc.type, exc.param, code)))


def error_response(exc: BaseException) -> Response:
    headers = {"Retry-After": "1"} if isinstance(exc, Overloaded) else None
    return Response(error_body(exc), status_code=status_of(exc), media_type="application/json", headers=headers)


_ENGINE_ERRORS = {
    FinishReason.REJECTED: (BadRequest, "the engine rejected the request"),
    FinishReason.OVERLOADED: (Overloaded, "the engine is overloaded"),
    FinishReason.UNAVAILABLE: (Unavailable, "the engine is unavailable"),
    FinishReason.ERROR: (EngineError, "the engine failed this request"),
}


def raise_for_engine_error(delta: ChoiceDelta) -> None:
    """A choice the engine ended with an error becomes the error of the whole request."""
    if delta.finish_reason in _ENGINE_ERRORS:
        kind, default = _ENGINE_ERRORS[delta.finish_reason]
        raise kind(delta.error or default)
    if delta.error is not None and not delta.token_ids:
        raise EngineError(delta.error)
