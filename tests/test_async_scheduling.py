"""Async scheduling: step N+1 is built and handed to the worker before step N's answer
is landed. The engine core that the offline `LLM` and the scheduler service both run is
driven here with the real scheduler core and the real model runner (the in-process
executor); greedy output must stay identical to transformers (and to the synchronous
engine), with nothing computed twice or lost."""

from __future__ import annotations

import pytest

from llmbus import LLM, SamplingParams
from services.scheduler.engine_core import EngineCore
from shared.messages import EngineCoreRequest, FinishReason
from test_scheduler import make_request, make_scheduler, runner_output
from tiny_models import hf_greedy, random_prompts

MAX_NEW = 20
PROMPTS = random_prompts([1, 7, 16, 17, 40, 90])


class CountingExecutor:
    """The LLM's own executor, counting the tokens each step sends to the runner."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.num_computed_tokens = 0

    async def execute(self, step, headers):
        self.num_computed_tokens += step.total_num_scheduled_tokens
        return await self.inner.execute(step, headers)


def run_pipelined(llm: LLM, requests: list[EngineCoreRequest], depth: int = 2, abort_after: dict | None = None):
    """Drive llm's scheduler core and model runner through an engine core with `depth`
    steps in flight. Returns each request's tokens and finish reason, and how many tokens
    the runner computed."""
    executor = CountingExecutor(llm.executor)
    engine = EngineCore(llm.scheduler, executor, depth)
    for request in requests:
        llm.scheduler.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    finish = {}
    abort_after = dict(abort_after or {})

    async def drive():
        while engine.busy():
            landed = await engine.step()
            assert landed is not None, "work left but nothing schedulable and nothing in flight"
            assert engine.num_in_flight < depth
            for outputs in landed.outputs.values():
                for o in outputs.outputs:
                    tokens[o.request_id] += o.new_token_ids
                    if o.finish_reason is not None:
                        finish[o.request_id] = o.finish_reason
                    if abort_after.get(o.request_id) == len(tokens[o.request_id]):
                        llm.scheduler.abort_requests([o.request_id])
                        finish[o.request_id] = FinishReason.ABORT

    llm.run_in_engine(drive())
    return tokens, finish, executor.num_computed_tokens


def greedy_requests(prompts, max_tokens=MAX_NEW, **params) -> list[EngineCoreRequest]:
    return [
        EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=p,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params),
            eos_token_id=None,
        )
        for i, p in enumerate(prompts)
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_NEW)


def assert_clean(llm: LLM) -> None:
    """Every block back in the pool and the worker holding no request state (the engine
    ran until idle: its last step carried the last finished ids to the runner)."""
    pool = llm.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert llm.runner.requests == {}


@pytest.mark.parametrize(
    "engine",
    [
        dict(),
        dict(max_num_batched_tokens=16, long_prefill_token_threshold=8),  # chunked prefill
        dict(num_kv_blocks=12, block_size=16, enable_prefix_caching=False),  # preemption
        dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=24),  # both, with prefix caching
    ],
    ids=["plain", "chunked", "preempting", "preempting-chunked-cached"],
)
def test_pipelined_greedy_output_matches_transformers(tiny_llama, reference, engine):
    llm = LLM(str(tiny_llama), **engine)
    tokens, finish, computed = run_pipelined(llm, greedy_requests(PROMPTS))
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert set(finish.values()) == {FinishReason.LENGTH}
    if "num_kv_blocks" in engine:
        assert llm.stats().num_preemptions > 0
    else:
        # A request whose last token is in flight gets no further step: with nothing
        # preempted, each token is computed exactly once (the last sampled one never is).
        assert computed == sum(len(p) + MAX_NEW - 1 for p in PROMPTS)
    assert_clean(llm)


def test_an_early_stop_discards_the_step_already_in_flight(tiny_llama, reference):
    """A stop token ends a request while its next step is in flight: the extra token is
    never reported, and the request's blocks and runner state are released."""
    llm = LLM(str(tiny_llama))
    # Stop each request on the first token from its 3rd on that it has not produced before.
    requests = greedy_requests(PROMPTS)
    stops = []
    for request, ref in zip(requests, reference):
        k = next(k for k in range(2, len(ref)) if ref[k] not in ref[:k])
        request.sampling_params.stop_token_ids = [ref[k]]
        stops.append(k)
    tokens, finish, _ = run_pipelined(llm, requests)
    for i, (ref, k) in enumerate(zip(reference, stops)):
        assert tokens[f"r{i}"] == ref[: k + 1]
        assert finish[f"r{i}"] == FinishReason.STOP
    assert_clean(llm)


def test_an_abort_while_steps_are_in_flight_loses_no_other_request(tiny_llama, reference):
    llm = LLM(str(tiny_llama))
    tokens, finish, _ = run_pipelined(llm, greedy_requests(PROMPTS), abort_after={"r2": 3, "r4": 1})
    for i, ref in enumerate(reference):
        if f"r{i}" in ("r2", "r4"):
            assert finish[f"r{i}"] == FinishReason.ABORT
            assert tokens[f"r{i}"] == ref[: len(tokens[f"r{i}"])]
        else:
            assert tokens[f"r{i}"] == ref
    assert_clean(llm)


def test_the_offline_llm_without_async_scheduling_gives_the_same_tokens(tiny_llama, reference):
    llm = LLM(str(tiny_llama), async_scheduling=False)
    assert llm.engine.max_steps_in_flight == 1
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == reference


def test_depth_one_is_the_synchronous_engine(tiny_llama, reference):
    llm = LLM(str(tiny_llama))
    tokens, _, _ = run_pipelined(llm, greedy_requests(PROMPTS), depth=1)
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference


# ---- the core alone ------------------------------------------------------------------


def test_a_request_is_scheduled_ahead_of_its_sampled_token():
    core = make_scheduler()
    core.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    first = core.schedule()  # the whole prompt: samples a token
    second = core.schedule()  # built before the first lands: decodes that token
    assert first.num_scheduled_tokens == {"a": 3}
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [3]
    assert core.requests["a"].num_output_placeholders == 2
    core.update_from_output(first, runner_output(first, {"a": [7]}))
    assert core.requests["a"].num_output_placeholders == 1
    assert core.requests["a"].output_token_ids == [7]


def test_no_step_is_built_past_max_tokens():
    core = make_scheduler()
    core.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    first = core.schedule()
    second = core.schedule()  # token 2 of 2
    third = core.schedule()  # would be token 3: not built
    assert second.num_scheduled_tokens == {"a": 1}
    assert third.num_scheduled_tokens == {}
    core.update_from_output(first, runner_output(first, {"a": [7]}))
    outputs = core.update_from_output(second, runner_output(second, {"a": [8]}))
    (out,) = [o for outs in outputs.values() for o in outs.outputs]
    assert out.finish_reason == FinishReason.LENGTH
    assert core.requests == {}


def test_a_request_preempted_with_a_token_in_flight_waits_for_it():
    """Its token must land before it is sent to the worker again as prompt + output."""
    core = make_scheduler(num_kv_blocks=3)  # 12 slots of 4
    core.add_request(make_request("a", [1] * 4, max_tokens=20))
    core.add_request(make_request("b", [2] * 4, max_tokens=20))
    first = core.schedule()  # both prompts: 2 blocks
    second = core.schedule()  # both decode into a new block each: 4 > 3, b is preempted
    assert "b" not in second.num_scheduled_tokens
    assert core.requests["b"].num_output_placeholders == 1  # from `first`, still in flight
    assert "b" not in core.schedule().num_scheduled_tokens  # cannot resume yet
    core.update_from_output(first, runner_output(first, {"a": [5], "b": [6]}))
    assert core.requests["b"].output_token_ids == [6]
    assert core.requests["b"].num_output_placeholders == 0
