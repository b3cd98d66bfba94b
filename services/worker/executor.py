"""How a step reaches the model runner: `launch_step` (a failure becomes an error answer,
never an exception) and the in-process executor the offline `LLM` and tests hand to the
engine core. (The worker service answers its steps through served_steps.py.)

Every torch call, model loading included, runs on one thread. A second thread that
touches torch gets its own OpenMP team, and from then on both teams run at ~1.5 of 2
cores (measured: a decode step went from 187 ms to 223 ms). So the runner is built on
the executor's own thread and only ever called there.

Offline, the engine core's event loop runs on that thread too and `execute` calls the
runner inline: it launches the step and the engine core finishes it when it lands it,
after launching the next (launched_step.py). Running the forward on the thread while the loop scheduled and
detokenized beside it was measured and lost: W1 bfloat16 368.6 and 369.8 output tok/s
against the one-at-a-time loop's 402.3 (ABBA, docs/performance/history.md). On two cores the
loop's Python work preempts one of the two OpenMP threads that run in lockstep, and the
stall costs more than the overlap hides. The worker service keeps its loop on another
thread (heartbeats must go on during a long step) and calls `run`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from services.worker.model_runner import ModelRunner
from shared.messages import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("llmbus.worker")

T = TypeVar("T")


def launch_step(runner: ModelRunner, step: SchedulerOutput) -> Launched:
    try:
        return Launched(runner, step, runner.launch(step))
    except Exception as exc:  # noqa: BLE001 - report the failure; the scheduler ends those requests
        return Launched(runner, step, None, exc)


class Launched:
    """A step handed to the runner: `finish()` is its answer, an error answer if it failed."""

    __slots__ = ("runner", "step", "launched", "exc")

    def __init__(self, runner: ModelRunner, step: SchedulerOutput, launched, exc: Exception | None = None) -> None:
        self.runner, self.step, self.launched, self.exc = runner, step, launched, exc

    @property
    def done(self) -> bool:
        """Whether `finish()` has nothing to wait for on the device."""
        return self.exc is not None or self.launched.finished

    def wait(self) -> None:
        """Block until the step's tokens are on the host, landing nothing: any thread may
        wait here while the runner's thread launches the next step."""
        if not self.done:
            self.launched.wait()

    def finish(self) -> ModelRunnerOutput:
        if self.exc is None:
            try:
                return self.launched.finish()
            except Exception as exc:  # noqa: BLE001
                self.exc = exc
        step = self.step
        log.error("step %d failed", step.step_id, exc_info=self.exc)
        # The runner's state for these requests may be half-updated: drop it, the
        # scheduler will not send them again.
        self.runner.drop_requests(list(step.num_scheduled_tokens))
        return ModelRunnerOutput(
            step_id=step.step_id, req_ids=[], sampled_token_ids=[], error=f"{type(self.exc).__name__}: {self.exc}",
        )


class InProcessExecutor:
    """A model runner in this process, on a thread of its own."""

    def __init__(self, make_runner: Callable[[], ModelRunner], threads: int | None = None) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        if threads:
            import torch

            # OpenMP's thread count is per calling thread: set it on the step thread itself.
            self.call(torch.set_num_threads, threads)
        self.runner = self.call(make_runner)
        self._ident = self.call(threading.get_ident)

    def call(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` on the runner's thread and wait for it (for torch work beside
        the steps: a benchmark's roofline, say)."""
        return self.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args) -> Future[T]:
        """`fn(*args)` queued on the runner's thread."""
        return self._thread.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Await `fn(*args)` on the runner's thread; calls run one at a time, in order."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def execute(self, step: SchedulerOutput, headers: dict[str, str] | None = None) -> Launched:
        """Inline: the engine core's loop must be running on the runner's thread (see `call`).
        The step is launched, not finished: the engine core finishes it when it lands it,
        after handing the runner the next one (services/worker/launched_step.py)."""
        if threading.get_ident() != self._ident:
            raise RuntimeError("InProcessExecutor.execute runs on the runner's thread: run the loop there")
        return launch_step(self.runner, step)

    def close(self) -> None:
        close = getattr(self.runner, "close", None)  # (a tensor-parallel runner's ranks stop with it)
        if close is not None:
            self.call(close)
        self._thread.shutdown(wait=True)
