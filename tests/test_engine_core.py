"""The engine core with a fake executor: the pipeline's depth, what it sends before an
answer lands, aborts while steps are in flight, and a worker that stops answering."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.engine_core import EngineCore, WorkerLost
from shared.messages import FinishReason, ModelRunnerOutput, SchedulerOutput
from test_scheduler import make_request, make_scheduler


class FakeExecutor:
    """Records every step handed over; answers only when the test says so."""

    def __init__(self) -> None:
        self.sent: list[SchedulerOutput] = []
        self._answers: dict[int, asyncio.Future] = {}

    async def execute(self, step: SchedulerOutput, headers) -> ModelRunnerOutput | None:
        self.sent.append(step)
        self._answers[step.step_id] = asyncio.get_running_loop().create_future()
        return await self._answers[step.step_id]

    def answer(self, step: SchedulerOutput, token: int = 7) -> None:
        """A token for every request whose prompt this step completes, as a worker would."""
        req_ids = list(step.num_scheduled_tokens)
        self._answers[step.step_id].set_result(ModelRunnerOutput(step.step_id, req_ids, [[token] for _ in req_ids]))

    def vanish(self, step: SchedulerOutput) -> None:
        self._answers[step.step_id].set_result(None)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _run(coro):
    return asyncio.run(coro)


def _engine(requests: dict[str, int], **options) -> tuple:
    """A scheduler holding `requests` (id -> max_tokens, 3-token prompts), a fake executor
    and the engine core between them."""
    scheduler = make_scheduler()
    for i, (request_id, max_tokens) in enumerate(requests.items()):
        scheduler.add_request(make_request(request_id, [3 * i + 1, 3 * i + 2, 3 * i + 3], max_tokens=max_tokens))
    executor = FakeExecutor()
    return scheduler, executor, EngineCore(scheduler, executor, **options)


async def _answer_until(done, executor: FakeExecutor) -> None:
    """Answer every step as it is sent until `done()`."""
    while not done():
        await _settle()
        for step in executor.sent:
            if not executor._answers[step.step_id].done():
                executor.answer(step)


def test_two_steps_are_sent_before_the_first_lands():
    async def scenario():
        scheduler, executor, engine = _engine({"a": 5}, max_steps_in_flight=2)
        stepping = asyncio.ensure_future(engine.step())
        await _settle()
        assert [s.num_scheduled_tokens for s in executor.sent] == [{"a": 3}, {"a": 1}]
        assert scheduler.requests["a"].num_output_placeholders == 2
        executor.answer(executor.sent[0])
        landed = await stepping
        (out,) = landed.outputs[""].outputs
        assert out.new_token_ids == [7]
        assert engine.num_in_flight == 1
        assert scheduler.requests["a"].num_output_placeholders == 1

    _run(scenario())


def test_depth_one_waits_for_each_answer():
    async def scenario():
        _, executor, engine = _engine({"a": 5}, max_steps_in_flight=1)
        stepping = asyncio.ensure_future(engine.step())
        await _settle()
        assert len(executor.sent) == 1
        executor.answer(executor.sent[0])
        await stepping
        assert engine.num_in_flight == 0

    _run(scenario())


def test_only_the_first_step_to_a_new_worker_resets_it():
    async def scenario():
        _, executor, engine = _engine({"a": 3}, needs_reset=True)
        stepping = asyncio.ensure_future(engine.drain())
        await _answer_until(stepping.done, executor)
        await stepping
        assert [s.reset for s in executor.sent] == [True] + [False] * (len(executor.sent) - 1)

    _run(scenario())


def test_an_abort_while_a_step_is_in_flight_drops_its_token_and_tells_the_worker():
    async def scenario():
        scheduler, executor, engine = _engine({"a": 10, "b": 10})
        stepping = asyncio.ensure_future(engine.step())
        await _settle()
        scheduler.abort_requests(["a"])  # both steps in flight carry it
        executor.answer(executor.sent[0])
        landed = await stepping
        assert [o.request_id for o in landed.outputs[""].outputs] == ["b"]
        stepping = asyncio.ensure_future(engine.step())  # sends the next step, lands the second
        await _settle()
        assert executor.sent[2].finished_req_ids == ["a"]
        assert "a" not in executor.sent[2].num_scheduled_tokens
        executor.answer(executor.sent[1])
        landed = await stepping
        assert [o.request_id for o in landed.outputs[""].outputs] == ["b"]

    _run(scenario())


def test_a_worker_that_stops_answering_is_lost_with_every_step_in_flight():
    async def scenario():
        scheduler, executor, engine = _engine({"a": 10})
        stepping = asyncio.ensure_future(engine.step())
        await _settle()
        executor.vanish(executor.sent[0])
        with pytest.raises(WorkerLost, match="no answer to step 1"):
            await stepping
        engine.close()
        assert engine.num_in_flight == 0
        # The request is still the scheduler's, with its place in line for another worker.
        assert [r.request_id for r in scheduler.take_unfinished()] == ["a"]

    _run(scenario())


def test_run_publishes_every_landed_step_and_sleeps_until_woken():
    async def scenario():
        scheduler, executor, engine = _engine({})
        published = []

        async def publish(landed):
            published.extend(o for outs in landed.outputs.values() for o in outs.outputs)

        running = asyncio.ensure_future(engine.run(publish))
        await _settle()
        assert executor.sent == []  # idle: nothing sent
        scheduler.add_request(make_request("a", [1, 2], max_tokens=2))
        engine.wake()
        await _answer_until(lambda: any(o.finish_reason is not None for o in published), executor)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert [o.new_token_ids for o in published] == [[7], [7]]
        assert published[-1].finish_reason == FinishReason.LENGTH

    _run(scenario())
