"""The served executor: a step is a NATS request on the worker's step subject.

The worker answers its steps strictly in order on one thread, so two requests in flight
are two steps queued there. No answer within the step deadline (or nobody subscribed)
means the worker is gone: the engine core then hears None.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError

from shared.bus import encode
from shared.messages import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("llmbus.scheduler")

_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


class NatsExecutor:
    def __init__(self, nc, subject: str, worker_id: str, step_timeout_s: float = 120.0) -> None:
        self.nc = nc
        self.subject = subject
        self.worker_id = worker_id
        self.step_timeout_s = step_timeout_s

    async def execute(self, step: SchedulerOutput, headers: dict[str, str]) -> ModelRunnerOutput | None:
        try:
            reply = await self.nc.request(
                self.subject, encode(step), timeout=self.step_timeout_s, headers=headers or None,
            )
        except (NatsTimeoutError, NoRespondersError, asyncio.TimeoutError) as exc:
            log.error("worker %s did not answer step %d: %s", self.worker_id, step.step_id, type(exc).__name__)
            return None
        try:
            return _decoder.decode(reply.data)
        except msgspec.DecodeError as exc:
            return ModelRunnerOutput(step.step_id, [], [], error=f"malformed step reply: {exc}")
