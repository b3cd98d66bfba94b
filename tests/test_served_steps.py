"""services/worker/shell/served_steps.py's order of launches and answers, with steps that stay
on a "device" until the test lets them land (as a GPU's would; on a CPU they come back
finished, and tests/test_launched_steps.py drives the real runner through llmbus serve):
the next step is launched before the one before is answered when it is already waiting;
an answer never waits for a next step that does not come; answers go out in order; an
unreadable step is answered with an error in its turn."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest

from services.worker.shell import served_steps
from services.worker.shell.served_steps import ServedSteps
from shared.bus import encode
from shared.messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from shared.tracing import setup_tracing

pytestmark = pytest.mark.timeout(30)


class Step:
    """A launched step on the fake device: `land()` lets its tokens reach the host."""

    def __init__(self, step_id: int, events: list) -> None:
        self.step_id, self.events, self._landed = step_id, events, threading.Event()

    def land(self) -> None:
        self._landed.set()

    @property
    def done(self) -> bool:
        return self._landed.is_set()

    def wait(self) -> None:
        self._landed.wait()

    def finish(self) -> ModelRunnerOutput:
        self._landed.wait()
        self.events.append(("finish", self.step_id))
        return ModelRunnerOutput(step_id=self.step_id, req_ids=[], sampled_token_ids=[])


class Msg:
    headers = None

    def __init__(self, data: bytes, answers: list) -> None:
        self.data, self._answers = data, answers

    async def respond(self, data: bytes) -> None:
        self._answers.append(msgspec.msgpack.decode(data, type=ModelRunnerOutput))


class Executor:
    runner = type("Runner", (), {"last_step_ns": (0, 0, 0, 0)})()

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


@pytest.fixture
def served(monkeypatch):
    events, steps, answers = [], {}, []
    finished_at_launch = set()  # step ids that come back finished

    def launch(runner, step: SchedulerOutput):
        events.append(("launch", step.step_id))
        steps[step.step_id] = Step(step.step_id, events)
        if step.step_id in finished_at_launch:
            steps[step.step_id].land()
        return steps[step.step_id]

    monkeypatch.setattr(served_steps, "launch_step", launch)
    served = ServedSteps(Executor(), setup_tracing("worker"))

    def put(step_id: int | None) -> None:
        data = b"\xc1" if step_id is None else encode(SchedulerOutput(step_id, [], CachedRequestData(), {}, 0))  # 0xc1: never msgpack
        served.put(Msg(data, answers))

    served.finished_at_launch = finished_at_launch
    return served, put, events, steps, answers


async def until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_a_waiting_step_is_launched_before_the_one_before_is_answered(served):
    served, put, events, steps, answers = served

    async def scenario():
        task = asyncio.create_task(served.run())
        put(1)
        put(2)  # already waiting when step 1 has been launched (the scheduler's two in flight)
        await until(lambda: ("launch", 2) in events)
        assert events == [("launch", 1), ("launch", 2)] and answers == []
        steps[1].land()
        await until(lambda: len(answers) == 1)
        assert events[2] == ("finish", 1) and answers[0].step_id == 1
        # Nothing else comes: step 2 is answered when its tokens land, not held for a step 3.
        await asyncio.sleep(0.05)
        assert len(answers) == 1
        steps[2].land()
        await until(lambda: len(answers) == 2)
        # A step 3 that arrives while step 4 is still waiting on the device... then 4 and 5.
        put(3)
        await until(lambda: ("launch", 3) in events)
        put(4)
        await until(lambda: ("launch", 4) in events)
        assert [a.step_id for a in answers] == [1, 2]  # 3 is still on the device
        steps[3].land()
        await until(lambda: len(answers) == 3)
        put(None)  # unreadable: answered with an error, after 4
        await asyncio.sleep(0.05)
        assert len(answers) == 3
        steps[4].land()
        await until(lambda: len(answers) == 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert [a.step_id for a in answers] == [1, 2, 3, 4, -1]
    assert "malformed step" in answers[-1].error and all(a.error is None for a in answers[:-1])


def test_a_step_that_comes_back_finished_is_answered_at_once(served):
    """(A CPU's steps, or one that needed its tokens on the host.)"""
    served, put, events, steps, answers = served
    served.finished_at_launch.update({1, 2})

    async def scenario():
        task = asyncio.create_task(served.run())
        put(1)
        await until(lambda: len(answers) == 1)
        put(2)
        await until(lambda: len(answers) == 2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert [a.step_id for a in answers] == [1, 2]
    assert events == [("launch", 1), ("finish", 1), ("launch", 2), ("finish", 2)]
