"""One-time tokens for KV transfers between hosts: the scheduler signs each remote load it
orders (which server, which slots, until when) with the deployment's secret; the worker
that serves the slots checks the signature and the time and takes each token once. The
bytes go over a plain TCP socket, never NATS (services/worker/kv_transfer.py): without a
valid token a server sends nothing.

The secret is LLMBUS_KV_TRANSFER_SECRET, the same on the scheduler and every worker
(`llmbus serve` makes one per deployment); with none, no remote load is ordered and a
block on another host is computed again."""

from __future__ import annotations

import hashlib
import hmac
import os
import time

import msgspec

SECRET_ENV = "LLMBUS_KV_TRANSFER_SECRET"
TOKEN_LIFETIME_S = 60.0  # (a step's loads run before its forward: well inside this)
# A drained worker serves its tier this long before it exits, so the workers that took its
# requests load their KV from it; the scheduler orders such loads for a second less.
DRAINED_TIER_SERVE_S = 3.0
DEPARTED_TIER_S = DRAINED_TIER_SERVE_S - 1.0


def secret_from_env() -> bytes | None:
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def _message(address: str, slots: list[int], expires: float) -> bytes:
    return msgspec.msgpack.encode([address, slots, expires])


def sign(secret: bytes, address: str, slots: list[int], now: float | None = None) -> tuple[str, float]:
    """(token, expiry) for loading `slots` from the server at `address`."""
    expires = round((time.time() if now is None else now) + TOKEN_LIFETIME_S, 3)
    return hmac.new(secret, _message(address, slots, expires), hashlib.sha256).hexdigest(), expires


class TokenCheck:
    """A server's side: valid, unexpired, and not seen before."""

    def __init__(self, secret: bytes, address: str) -> None:
        self.secret, self.address = secret, address
        self._used: dict[str, float] = {}  # token/rank -> its expiry (kept until then: a replay is refused)

    def accept(self, token: str, expires: float, slots: list[int], now: float | None = None,
               rank: int = 0) -> str | None:
        """None if the transfer may go; else why not. A tensor-parallel worker's ranks each
        fetch their own heads of the same slots with the one token: once each (`rank`)."""
        now = time.time() if now is None else now
        self._used = {t: e for t, e in self._used.items() if e > now}
        if expires <= now:
            return "the token expired"
        expected = hmac.new(self.secret, _message(self.address, slots, expires), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, token):
            return "the token is not this transfer's"
        used = f"{token}/{rank}"
        if used in self._used:
            return "the token was used"
        self._used[used] = expires
        return None
