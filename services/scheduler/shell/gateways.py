"""Which gateways are alive, by the outputs subject each request names.

A gateway that dies takes its clients' connections with it, but not its requests: the
scheduler would run them to their last token (a chat without max_tokens, to the end of
the context), holding KV blocks and batch rows the live gateways' requests wait for.
Each gateway process has a subject of its own and says so twice a second
(`GatewayHeartbeat`); one not heard for `timeout_s` is declared gone, and the service
drops its requests. A gateway that was only silent (its host did not run it, a network
gap) and speaks again is told to send its open requests again, resumed from what it
streamed: dropping never loses a stream that still has a reader. A subject that never
sent a heartbeat is not judged at all.

A plain object on the scheduler's clock; its silence counts only while the scheduler
was awake to hear (wakefulness.py), as the workers' does.
"""

from __future__ import annotations

from services.scheduler.shell.wakefulness import Wakefulness

# How long a dropped gateway is remembered, to tell it to resume if it speaks again.
FORGET_DROPPED_S = 600.0


class Gateways:
    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self.last_heard: dict[str, float] = {}  # reply subject -> when
        self.dropped: dict[str, float] = {}  # reply subject -> when its requests were dropped

    def heard(self, reply_subject: str, now: float) -> bool:
        """A heartbeat. True when its requests had been dropped: tell it to resume them."""
        self.last_heard[reply_subject] = now
        return self.dropped.pop(reply_subject, None) is not None

    def silent(self, now: float, awake: Wakefulness | None = None) -> list[str]:
        """The gateways silent for longer than the timeout, each returned once: drop their
        requests now."""
        gone = []
        for subject, heard in list(self.last_heard.items()):
            silent = now - heard if awake is None else awake.silent_for(heard, now)
            if silent > self.timeout_s:
                del self.last_heard[subject]
                self.dropped[subject] = now
                gone.append(subject)
        for subject, at in list(self.dropped.items()):
            if now - at > FORGET_DROPPED_S:
                del self.dropped[subject]
        return gone
