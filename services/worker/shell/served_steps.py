"""How the worker service answers its step requests: in the order they came, each launched
as soon as it is read, each answered once its tokens are on the host.

The runner launches a step (forward and sampling queued on the device) apart from
finishing it (its tokens on the host; launched_step.py). Offline, the engine core launches
step N+1 before it lands N. Served, the scheduler keeps two steps in flight (async
scheduling), so N+1 is often on the worker's subject already when N has been launched:
then N+1 is launched first and N finished after, and the device computes N+1 while the
host copies N's tokens back, encodes and sends its answer and reads the next message. An
answer never waits for a step that may not come: while the newest step runs, whichever
comes first — the next step, or the newest step's tokens — decides. Its tokens are
waited for on a thread of their own: the step thread must stay free to launch.

On a CPU a launched step comes back finished (`ModelRunner.overlap_steps`: the work is
done when launch returns), so every step is answered as soon as it is run, as before.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from services.worker.executor import InProcessExecutor, Launched, launch_step
from shared.bus import encode
from shared.messages import ModelRunnerOutput, SchedulerOutput
from shared.tracing import extract

log = logging.getLogger("llmbus.worker")


@dataclass(slots=True, eq=False)
class _Unanswered:
    msg: object  # the NATS request, answered with msg.respond
    launched: Launched | None  # None: the request could not be read (`output` says why)
    span: object = None
    output: ModelRunnerOutput | None = None
    phases_ns: tuple[int, int, int, int] = (0, 0, 0, 0)  # the runner's last_step_ns at launch

    @property
    def done(self) -> bool:
        """Whether its answer is ready without waiting for the device."""
        return self.launched is None or self.launched.done


def _wait_quietly(launched: Launched) -> None:
    """Until its tokens are on the host; a failure is for `finish()` to report, in order."""
    try:
        launched.wait()
    except Exception:  # noqa: BLE001
        pass


class ServedSteps:
    """Step requests in, answers out; `put` each message as it arrives, `run` answers."""

    def __init__(self, executor: InProcessExecutor, tracer) -> None:
        self._executor = executor
        self._runner = executor.runner
        self._tracer = tracer
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ready_waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-ready")

    def put(self, msg) -> None:
        """A step request from the subscription (its callback must not wait for the step:
        nats-py hands a subscription's messages over one at a time)."""
        self._queue.put_nowait(msg)

    async def run(self) -> None:
        newest: _Unanswered | None = None  # launched, its tokens still on the device
        try:
            while True:
                msg = await self._next(newest)
                if msg is None:  # newest's tokens reached the host first
                    answers, newest = await self._executor.run(self._finish_all, [newest]), None
                else:
                    answers, newest = await self._executor.run(self._launch, msg, newest)
                for step, output in answers:
                    await self._respond(step, output)
        finally:
            self._ready_waiter.shutdown(wait=False)

    async def _next(self, newest: _Unanswered | None):
        """The next step request; None if `newest`'s tokens reached the host first."""
        if not self._queue.empty() or newest is None or newest.done:
            return await self._queue.get()
        loop = asyncio.get_running_loop()
        get = asyncio.ensure_future(self._queue.get())
        ready = loop.run_in_executor(self._ready_waiter, _wait_quietly, newest.launched)
        await asyncio.wait((get, ready), return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()  # (ready or not: launching the next one first is never worse)
        get.cancel()
        return None

    def _launch(self, msg, before: _Unanswered | None):
        """On the step thread: launch the step in `msg`, then finish the one before it (the
        device has the new one queued behind it) and the new one too if nothing of it is
        left on the device. -> (the answers, in order; the new step if still unanswered)."""
        try:
            step: SchedulerOutput = self._decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            new = _Unanswered(msg, None, output=ModelRunnerOutput(step_id=-1, req_ids=[], sampled_token_ids=[],
                                                                  error=f"malformed step: {exc}"))
        else:
            span = self._tracer.start_span("worker.execute", context=extract(msg.headers))
            new = _Unanswered(msg, launch_step(self._runner, step), span, phases_ns=self._runner.last_step_ns)
        done = [before] if before is not None else []
        if new.done:
            return self._finish_all(done + [new]), None
        return self._finish_all(done), new

    def _finish_all(self, steps: list[_Unanswered]) -> list[tuple[_Unanswered, ModelRunnerOutput]]:
        return [(step, self._finish(step)) for step in steps]

    def _finish(self, step: _Unanswered) -> ModelRunnerOutput:
        """On the step thread."""
        if step.launched is None:
            return step.output
        output = step.launched.finish()
        span = step.span
        if span.is_recording() and output.error is None:
            # Preparation, forward and sampling as attributes, not child spans: one span a
            # step is cheaper, and the phases are fixed.
            start, forward, sample, end = step.phases_ns
            span.set_attributes({
                "llmbus.num_requests": len(output.req_ids),
                "llmbus.prepare_ms": (forward - start) / 1e6,
                "llmbus.forward_ms": (sample - forward) / 1e6,
                "llmbus.sample_ms": (end - sample) / 1e6,
            })
        span.end()
        return output

    async def _respond(self, step: _Unanswered, output: ModelRunnerOutput) -> None:
        try:
            await step.msg.respond(encode(output))
        except Exception as exc:  # noqa: BLE001 - the connection is going: the scheduler re-places the step's requests
            log.warning("step %d: answer not sent (%s)", output.step_id, type(exc).__name__)
