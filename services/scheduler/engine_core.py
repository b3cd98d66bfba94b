"""The engine core: the step pipeline between one scheduler core and one worker.

`schedule()` -> the `SchedulerOutput` goes to an executor -> its `ModelRunnerOutput` is
landed -> `update_from_output()` -> `EngineCoreOutputs` by reply subject. With
`max_steps_in_flight=2` (async scheduling, the default) step N+1 is built and handed
over while step N runs, so the worker finds its next step waiting when it answers: the
transport's round trip and this object's own work hide behind the forward pass. The
scheduler core already counts tokens of steps in flight (placeholders) and drops tokens
of requests that ended meanwhile, so nothing here depends on the depth but the count.

The executor is the only transport: a direct call into the model runner offline
(`services.worker.executor.InProcessExecutor`) or a NATS request to a worker process
(`services.scheduler.shell.nats_executor.NatsExecutor`). The offline `LLM`, the scheduler
service and the tests all drive this one object.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace

from services.scheduler.core.scheduler import Scheduler
from services.scheduler.step_tracer import StepTracer
from shared.messages import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from shared.tracing import inject


class Launched(Protocol):
    def finish(self) -> ModelRunnerOutput:
        """The step's answer, once its tokens are on the host."""
        ...


class Executor(Protocol):
    async def execute(self, step: SchedulerOutput, headers: dict[str, str]) -> ModelRunnerOutput | Launched | None:
        """The worker's answer to one step, or a step launched in this process whose answer
        `finish()` gives; None when it cannot answer (gone, or past its deadline). Steps
        run in the order they are handed over, each after the one before."""
        ...


class WorkerLost(RuntimeError):
    """The executor gave no answer: the worker is gone and so is every step in flight."""


@dataclass(slots=True)
class LandedStep:
    outputs: dict[str, EngineCoreOutputs]  # by reply subject
    step_time_s: float  # the worker's time on it: from when it could start it to its answer


@dataclass(slots=True)
class _InFlight:
    """A step handed to the executor whose answer has not been landed yet."""

    step: SchedulerOutput
    span: trace.Span
    sent_at: float
    reply: asyncio.Future  # -> ModelRunnerOutput | None


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        max_steps_in_flight: int = 2,
        tracer: StepTracer | None = None,
        worker_id: str = "",
        needs_reset: bool = False,
    ) -> None:
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be at least 1, got {max_steps_in_flight}")
        self.scheduler = scheduler
        self.executor = executor
        self.max_steps_in_flight = max_steps_in_flight
        self.tracer = tracer or StepTracer.disabled()
        self.worker_id = worker_id
        # A worker new to this core may hold state from before (an earlier scheduler, or
        # its own false death): the first step it gets tells it to drop everything.
        self.needs_reset = needs_reset
        self._in_flight: deque[_InFlight] = deque()
        self._last_answer_at = 0.0
        self._wake = asyncio.Event()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def busy(self) -> bool:
        """Anything to schedule, to tell the worker, or to land."""
        return bool(self._in_flight) or self.scheduler.has_work()

    def wake(self) -> None:
        """New work (a request, an abort) for `run`'s idle wait."""
        self._wake.set()

    # ---- the pipeline ---------------------------------------------------------------

    async def step(self) -> LandedStep | None:
        """Fill the pipeline up to its depth, then land the oldest step. None when nothing
        is in flight because nothing could be scheduled. Raises WorkerLost."""
        while len(self._in_flight) < self.max_steps_in_flight and self.scheduler.has_work():
            if self._in_flight and not self.scheduler.may_build_ahead():
                break  # speculating: the next step is built once this one's drafts are known
            step = self.scheduler.schedule()
            if not (step.num_scheduled_tokens or step.finished_req_ids):
                break  # nothing fits right now
            step.reset, self.needs_reset = self.needs_reset, False
            self._in_flight.append(self._send(step))
        if not self._in_flight:
            return None
        return await self._land()

    async def drain(self) -> list[LandedStep]:
        """Step until nothing is left to schedule, to tell the worker or to land."""
        landed = []
        while self.busy():
            result = await self.step()
            if result is None:
                break  # work that cannot be scheduled (it waits for blocks that never free)
            landed.append(result)
        return landed

    async def run(self, publish) -> None:
        """Keep the worker busy until it is lost (WorkerLost) or this task is cancelled;
        `publish(landed)` is awaited with every landed step."""
        try:
            while True:
                landed = await self.step()
                if landed is not None:
                    await publish(landed)
                elif self.scheduler.has_work():
                    await asyncio.sleep(0.01)  # nothing fits right now; let the event loop breathe
                else:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.close()

    def close(self) -> None:
        """Forget the steps in flight (the worker is gone, or this core is being dropped)."""
        for sent in self._in_flight:
            sent.reply.cancel()
            sent.span.end()
        self._in_flight.clear()

    def _send(self, step: SchedulerOutput) -> _InFlight:
        span = self.tracer.start(self.scheduler, step, self.worker_id)
        headers = inject(trace.set_span_in_context(span)) if span.is_recording() else {}
        reply = asyncio.ensure_future(self.executor.execute(step, headers))
        return _InFlight(step, span, time.monotonic(), reply)

    async def _land(self) -> LandedStep:
        sent = self._in_flight[0]  # stays in the deque while awaited, so close() still sees it
        runner_output = await sent.reply
        if runner_output is not None and not isinstance(runner_output, ModelRunnerOutput):
            # Launched in this process: let the steps handed over after it launch first, so
            # the device has the next one queued while this one lands.
            await asyncio.sleep(0)
            runner_output = runner_output.finish()
        self._in_flight.popleft()
        now = time.monotonic()
        # The worker could start this step when it was sent or when the step before it was
        # answered, whichever came last.
        step_time = now - max(sent.sent_at, self._last_answer_at)
        self._last_answer_at = now
        if runner_output is None:
            StepTracer.end(sent.span, "worker did not answer")
            raise WorkerLost(f"no answer to step {sent.step.step_id}")
        outputs = self.scheduler.update_from_output(sent.step, runner_output)
        StepTracer.end(sent.span, runner_output.error, runner_output)
        return LandedStep(outputs, step_time)
