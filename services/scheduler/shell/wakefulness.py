"""How long the scheduler has been running without a break, for judging another's silence.

A service that declares a peer dead after N seconds without a message must not count
time in which it did not run itself: when a loaded host deschedules it, the peer's
messages wait unread in its socket, and on waking it would see a silence that never was
(the scheduler once removed both workers of `llmbus serve` for it). A ticker calls `tick`
every fraction of a second; a gap between ticks longer than `stall_s` was a stall, and
silence counts from its end. Until the ticker has run since the stall, nothing is silent.
"""

from __future__ import annotations

import time


class Wakefulness:
    def __init__(self, stall_s: float = 1.0, now: float | None = None) -> None:
        self.stall_s = stall_s
        self._ticked = self.awake_since = time.monotonic() if now is None else now

    def tick(self, now: float) -> None:
        if now - self._ticked > self.stall_s:
            self.awake_since = now
        self._ticked = now

    def silent_for(self, last_heard: float, now: float) -> float:
        """Seconds of silence since `last_heard` that this process was awake for."""
        if now - self._ticked > self.stall_s:
            return 0.0  # the ticker has not run since a stall (or is blocked): nothing counts yet
        return max(0.0, now - max(last_heard, self.awake_since))
