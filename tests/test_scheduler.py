"""The scheduler core, driven through its real interface: EngineCoreRequests in,
SchedulerOutputs out, hand-built ModelRunnerOutputs back."""

from __future__ import annotations

import random

import pytest

from services.scheduler.core.request import RequestStatus
from services.scheduler.core.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.messages import (
    CachedRequestData,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from shared.sampling_params import SamplingParams

BLOCK_SIZE = 4
VOCAB = 100
EOS = 99


def make_scheduler(num_kv_blocks: int = 64, prefix_caching: bool = True, **config) -> Scheduler:
    return Scheduler(
        SchedulerConfig(enable_prefix_caching=prefix_caching, **config),
        num_kv_blocks=num_kv_blocks,
        block_size=BLOCK_SIZE,
        vocab_size=VOCAB,
    )


def make_request(request_id: str, prompt, eos: int | None = EOS, **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(**params),
        eos_token_id=eos,
        arrival_time=1.0,
    )


def runner_output(so: SchedulerOutput, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        step_id=so.step_id,
        req_ids=req_ids,
        sampled_token_ids=[sampled.get(rid, []) for rid in req_ids],
    )


def step(scheduler: Scheduler, tokens: dict[str, int] | None = None, default: int = 7):
    """One engine step, as the worker would answer it: a token for every request whose
    prompt is fully computed after this step (from `tokens`, else `default`), none for
    a prompt chunk with more to come."""
    tokens = tokens or {}
    so = scheduler.schedule()
    sampled = {}
    for rid in so.num_scheduled_tokens:
        request = scheduler.requests[rid]
        if request.num_computed_tokens >= request.num_tokens:
            sampled[rid] = [tokens.get(rid, default)]
    outputs = scheduler.update_from_output(so, runner_output(so, sampled))
    return so, outputs


def only_output(outputs: dict[str, EngineCoreOutputs], request_id: str):
    (found,) = [o for outs in outputs.values() for o in outs.outputs if o.request_id == request_id]
    return found


def check_ref_counts(scheduler: Scheduler) -> None:
    """Every block's ref count is the number of requests holding it, and it is free
    exactly when that is zero."""
    kv = scheduler.kv_cache_manager
    holders = [0] * kv.block_pool.num_blocks
    for blocks in kv.req_to_blocks.values():
        for block in blocks:
            holders[block.block_id] += 1
    assert [b.ref_cnt for b in kv.block_pool.blocks] == holders
    assert all(b.ref_cnt >= 0 for b in kv.block_pool.blocks)
    assert kv.block_pool.num_free_blocks == holders.count(0)
    assert set(kv.req_to_blocks) <= set(scheduler.requests)


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.num_free_blocks == kv.block_pool.num_blocks
    assert kv.usage == 0.0
    assert kv.req_to_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


# ---- chunked prefill and the token budget ------------------------------------------------


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    scheduler = make_scheduler(num_kv_blocks=64, max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", range(100)))

    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 32}
    assert so.total_num_scheduled_tokens == 32
    (new,) = so.scheduled_new_reqs
    assert isinstance(new, NewRequestData)
    assert (new.req_id, new.num_computed_tokens, new.block_ids) == ("a", 0, list(range(8)))
    assert new.output_token_ids == []
    assert so.scheduled_cached_reqs == CachedRequestData()
    # A prompt chunk with more to come samples nothing and yields no output.
    assert scheduler.update_from_output(so, runner_output(so, {})) == {}
    assert scheduler.requests["a"].output_token_ids == []

    for computed, block_ids in ((32, range(8, 16)), (64, range(16, 24))):
        so = scheduler.schedule()
        assert so.num_scheduled_tokens == {"a": 32}
        assert so.scheduled_new_reqs == []
        assert so.scheduled_cached_reqs == CachedRequestData(["a"], [list(block_ids)], [computed])
        assert scheduler.update_from_output(so, runner_output(so, {})) == {}

    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_cached_reqs == CachedRequestData(["a"], [[24]], [96])
    outputs = scheduler.update_from_output(so, runner_output(so, {"a": [42]}))
    out = only_output(outputs, "a")
    assert out.new_token_ids == [42]
    assert out.finish_reason is None
    assert scheduler.requests["a"].output_token_ids == [42]

    # Then one token a step; the 101st token needs a 26th block.
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs == CachedRequestData(["a"], [[25]], [100])


def test_long_prefill_threshold_caps_one_requests_share_of_the_step():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("a", range(20)))
    scheduler.add_request(make_request("b", range(20, 40)))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    assert so.total_num_scheduled_tokens == 16


def test_without_a_threshold_the_first_request_takes_what_it_needs():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", range(20)))
    scheduler.add_request(make_request("b", range(20, 40)))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 20, "b": 12}


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it_whole():
    scheduler = make_scheduler(
        max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", range(20)))
    scheduler.add_request(make_request("b", range(20, 40)))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 20}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20}


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", range(30)))
    scheduler.add_request(make_request("b", range(30, 34)))
    # a (older) takes the whole budget, b waits.
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 10}
    # a is running now: it keeps going ahead of b.
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 10}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 10}
    # a's one decode token first, the rest of the budget to b.
    so, _ = step(scheduler)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 4)]
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]


def test_no_more_than_max_num_seqs_requests_run_at_once():
    scheduler = make_scheduler(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        scheduler.add_request(make_request(rid, range(10 * i, 10 * i + 4), max_tokens=2))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    so, outputs = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert only_output(outputs, "a").finish_reason == FinishReason.LENGTH
    assert only_output(outputs, "b").finish_reason == FinishReason.LENGTH
    # Both finished: c gets its turn, and the worker is told to drop a and b.
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"c": 4}
    assert so.finished_req_ids == ["a", "b"]


# ---- preemption -------------------------------------------------------------------------


def test_the_newest_running_request_is_preempted_when_blocks_run_out():
    # 4 blocks of 4 tokens; two 7-token prompts fill them all after their first decode.
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=2)
    scheduler.add_request(make_request("a", range(1, 8), max_tokens=3))
    scheduler.add_request(make_request("b", range(11, 18), max_tokens=5))
    scheduler.add_request(make_request("c", [21, 22, 23], max_tokens=5))

    so, _ = step(scheduler, {"a": 50, "b": 60})
    assert so.num_scheduled_tokens == {"a": 7, "b": 7}
    assert [n.block_ids for n in so.scheduled_new_reqs] == [[0, 1], [2, 3]]
    so, _ = step(scheduler, {"a": 51, "b": 61})
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 0

    # a's 9th token needs a third block: b (the newest) gives back its blocks, tail first.
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs == CachedRequestData(["a"], [[3]], [8])
    assert so.finished_req_ids == ["b"]  # the worker drops b's state before this step
    assert scheduler.num_preemptions == 1
    assert scheduler.make_stats().num_preemptions == 1
    b = scheduler.waiting[0]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert (b.request_id, b.status, b.num_computed_tokens) == ("b", RequestStatus.PREEMPTED, 0)
    assert b.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    outputs = scheduler.update_from_output(so, runner_output(so, {"a": [52]}))
    assert only_output(outputs, "a").finish_reason == FinishReason.LENGTH

    # a is done; b comes back first, as new data with the tokens it had generated.
    # Its first block is still cached (block 2); its second was taken by a.
    so = scheduler.schedule()
    assert so.finished_req_ids == ["a"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b", "c"]
    resumed = so.scheduled_new_reqs[0]
    assert resumed.prompt_token_ids == list(range(11, 18))
    assert resumed.output_token_ids == [60, 61]
    assert resumed.block_ids == [2, 3, 1]
    assert resumed.num_computed_tokens == 4
    assert so.num_scheduled_tokens == {"b": 5, "c": 3}
    assert so.scheduled_new_reqs[1].block_ids == [0]
    outputs = scheduler.update_from_output(so, runner_output(so, {"b": [62], "c": [70]}))
    assert only_output(outputs, "b").new_token_ids == [62]
    assert scheduler.requests["b"].output_token_ids == [60, 61, 62]
    check_ref_counts(scheduler)


def prioritized(request_id: str, prompt, priority: int, arrival: float, **params) -> EngineCoreRequest:
    request = make_request(request_id, prompt, **params)
    request.priority, request.arrival_time = priority, arrival
    return request


def test_under_the_priority_policy_the_lowest_priority_value_is_admitted_first():
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for rid, priority, arrival in (("late-urgent", 0, 3.0), ("early-lax", 5, 1.0), ("mid", 1, 2.0),
                                   ("urgent", 0, 2.5)):
        scheduler.add_request(prioritized(rid, [1, 2, 3], priority, arrival, max_tokens=1))
    admitted = [step(scheduler)[0].scheduled_new_reqs[0].req_id for _ in range(4)]
    assert admitted == ["urgent", "late-urgent", "mid", "early-lax"]  # by priority, then arrival


def test_under_the_priority_policy_the_lowest_priority_running_request_is_preempted():
    """Two 7-token prompts fill the 4 blocks. `lax` runs first (it came first) and is the
    first to need a block: it gives its own back, as the running request last in
    priority order (FCFS would take the newest, `urgent`), and `urgent` runs on in the
    same step; `lax` waits again ahead of its equals that came later."""
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=2, scheduling_policy="priority")
    scheduler.add_request(prioritized("lax", range(11, 18), 9, 1.0, max_tokens=5))
    step(scheduler)
    scheduler.add_request(prioritized("urgent", range(1, 8), 0, 2.0, max_tokens=5))
    scheduler.add_request(prioritized("lax-later", [21, 22], 9, 3.0, max_tokens=5))
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["lax", "urgent"]
    so = scheduler.schedule()
    assert so.finished_req_ids == ["lax"] and so.num_scheduled_tokens == {"urgent": 1}
    assert [r.request_id for r in scheduler.waiting] == ["lax", "lax-later"]
    check_ref_counts(scheduler)


def test_a_priority_without_the_priority_policy_is_refused():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        scheduler.add_request(prioritized("a", [1, 2], 1, 1.0))
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_scheduler(scheduling_policy="lifo")


def test_a_step_that_preempts_admits_no_waiting_request():
    # No prefix cache and a 4-token cap per request, so a preempted request would fit
    # again at once with a small chunk: the scheduler must still leave it for next step.
    scheduler = make_scheduler(
        num_kv_blocks=4, prefix_caching=False, max_num_batched_tokens=16,
        long_prefill_token_threshold=4,
    )
    scheduler.add_request(make_request("a", range(4)))
    scheduler.add_request(make_request("b", range(10, 22)))
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    so, _ = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 0
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == ["b"]
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 2
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    scheduler.update_from_output(so, runner_output(so, {"a": [5]}))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 4}
    assert so.finished_req_ids == []
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]


# ---- finishing ------------------------------------------------------------------------------


def run_to_finish(scheduler: Scheduler, request_id: str, tokens: list[int]):
    """Feed `tokens` one per step to a single request; return its outputs in order."""
    seen = []
    for token in tokens:
        _, outputs = step(scheduler, {request_id: token})
        out = only_output(outputs, request_id)
        seen.append(out)
        if out.finish_reason is not None:
            break
    return seen


def test_eos_finishes_a_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5)))
    outs = run_to_finish(scheduler, "a", [3, 4, EOS, 5])
    assert [o.new_token_ids for o in outs] == [[3], [4], [EOS]]
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.STOP]
    assert outs[-1].stop_reason is None
    assert "a" not in scheduler.requests
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_eos_is_ignored_with_ignore_eos():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), ignore_eos=True, max_tokens=3))
    outs = run_to_finish(scheduler, "a", [EOS, EOS, EOS])
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.LENGTH]


def test_a_request_without_an_eos_token_is_not_stopped_by_any_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), eos=None, max_tokens=2))
    outs = run_to_finish(scheduler, "a", [EOS, EOS])
    assert [o.finish_reason for o in outs] == [None, FinishReason.LENGTH]


def test_eos_does_not_stop_before_min_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), min_tokens=3))
    outs = run_to_finish(scheduler, "a", [EOS, EOS, EOS, EOS])
    assert [o.finish_reason for o in outs] == [None, None, FinishReason.STOP]


def test_a_stop_token_id_finishes_with_it_as_the_stop_reason():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), stop_token_ids=[42, 43]))
    outs = run_to_finish(scheduler, "a", [1, 43, 2])
    assert [o.new_token_ids for o in outs] == [[1], [43]]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == (FinishReason.STOP, 43)


def test_stop_token_ids_do_not_stop_before_min_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), stop_token_ids=[42], min_tokens=2))
    outs = run_to_finish(scheduler, "a", [42, 42, 1])
    assert [o.finish_reason for o in outs] == [None, FinishReason.STOP]
    assert outs[-1].stop_reason == 42


def test_max_tokens_finishes_with_length():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), max_tokens=2))
    outs = run_to_finish(scheduler, "a", [1, 2, 3])
    assert [o.finish_reason for o in outs] == [None, FinishReason.LENGTH]
    assert outs[-1].stop_reason is None
    assert_all_blocks_free(scheduler)


def test_max_tokens_none_is_capped_by_the_context():
    scheduler = make_scheduler(max_model_len=10)
    scheduler.add_request(make_request("a", range(6), max_tokens=None))
    assert scheduler.requests["a"].max_tokens == 4
    outs = run_to_finish(scheduler, "a", [1, 2, 3, 4, 5])
    assert [o.finish_reason for o in outs] == [None, None, None, FinishReason.LENGTH]


def test_max_tokens_beyond_the_context_is_capped_too():
    scheduler = make_scheduler(max_model_len=10)
    scheduler.add_request(make_request("a", range(6), max_tokens=100))
    assert scheduler.requests["a"].max_tokens == 4


def test_the_context_is_capped_by_the_kv_cache():
    scheduler = make_scheduler(num_kv_blocks=3, max_model_len=2048)
    assert scheduler.max_model_len == 12
    scheduler.add_request(make_request("a", range(10), max_tokens=None))
    assert scheduler.requests["a"].max_tokens == 2


# ---- aborts ---------------------------------------------------------------------------------


def test_aborting_a_running_request_frees_its_blocks_and_tells_the_worker():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(10)))
    step(scheduler)
    assert scheduler.kv_cache_manager.get_block_ids("a") == [0, 1, 2]
    scheduler.abort_requests(["a"])
    assert_all_blocks_free(scheduler)
    assert "a" not in scheduler.requests
    assert scheduler.running == []
    assert not scheduler.has_unfinished_requests()
    so = scheduler.schedule()
    assert so.finished_req_ids == ["a"]
    assert so.num_scheduled_tokens == {}
    assert scheduler.schedule().finished_req_ids == []


def test_aborting_a_waiting_request_removes_it_without_telling_the_worker():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", range(10)))
    scheduler.add_request(make_request("b", range(10, 20)))
    step(scheduler)
    scheduler.abort_requests(["b"])
    assert [r.request_id for r in scheduler.waiting] == []
    assert "b" not in scheduler.requests
    assert scheduler.kv_cache_manager.get_block_ids("a") == [0, 1, 2]
    so, _ = step(scheduler)
    assert so.finished_req_ids == []
    assert so.num_scheduled_tokens == {"a": 1}
    scheduler.abort_requests(["a"])
    assert_all_blocks_free(scheduler)


def test_aborting_a_preempted_request_frees_nothing_twice():
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=2)
    scheduler.add_request(make_request("a", range(1, 8)))
    scheduler.add_request(make_request("b", range(11, 18)))
    step(scheduler)
    step(scheduler)
    step(scheduler)  # preempts b
    assert scheduler.waiting[0].status == RequestStatus.PREEMPTED
    scheduler.abort_requests(["b", "a"])
    assert_all_blocks_free(scheduler)
    assert not scheduler.has_unfinished_requests()
    # b was already dropped by the worker at its preemption; only a is left to drop.
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_aborting_an_unknown_or_finished_request_is_a_no_op():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(5), max_tokens=1))
    step(scheduler)
    scheduler.abort_requests(["a", "nope"])
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_an_output_for_an_aborted_request_is_ignored():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(10)))
    scheduler.add_request(make_request("b", range(10, 20)))
    so = scheduler.schedule()
    scheduler.abort_requests(["a"])  # while the step is in flight
    outputs = scheduler.update_from_output(so, runner_output(so, {"a": [5], "b": [6]}))
    assert [o.request_id for outs in outputs.values() for o in outs.outputs] == ["b"]
    assert "a" not in scheduler.requests
    assert scheduler.kv_cache_manager.get_block_ids("a") == []
    check_ref_counts(scheduler)
    so = scheduler.schedule()
    assert so.finished_req_ids == ["a"]
    assert so.num_scheduled_tokens == {"b": 1}


# ---- bad input ------------------------------------------------------------------------------


def snapshot(scheduler: Scheduler):
    return (
        sorted(scheduler.requests),
        [r.request_id for r in scheduler.waiting],
        [r.request_id for r in scheduler.running],
        scheduler.kv_cache_manager.block_pool.num_free_blocks,
    )


@pytest.mark.parametrize(
    "prompt, message",
    [
        (list(range(16)), "prompt is 16 tokens, but the model's context is 16 tokens"),
        (list(range(20)), "prompt is 20 tokens, but the model's context is 16 tokens"),
        ([], "prompt must contain at least one token"),
        ([1, 2, VOCAB, 3], r"prompt token id 100 is outside the vocabulary \[0, 100\)"),
        ([1, -1], r"prompt token id -1 is outside the vocabulary"),
    ],
)
def test_a_bad_prompt_is_rejected_and_changes_nothing(prompt, message):
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("ok", [1, 2, 3]))
    before = snapshot(scheduler)
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(make_request("bad", prompt))
    assert snapshot(scheduler) == before
    assert "bad" not in scheduler.requests
    # Nothing of it reaches the worker.
    assert scheduler.schedule().num_scheduled_tokens == {"ok": 3}


def test_a_prompt_one_token_short_of_the_context_is_accepted():
    scheduler = make_scheduler(max_model_len=16)
    scheduler.add_request(make_request("a", range(15)))
    assert scheduler.requests["a"].max_tokens == 1


def test_a_duplicate_request_id_is_rejected_and_changes_nothing():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    step(scheduler)
    before = snapshot(scheduler)
    original = scheduler.requests["a"]
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        scheduler.add_request(make_request("a", [4, 5, 6]))
    assert snapshot(scheduler) == before
    assert scheduler.requests["a"] is original
    assert original.prompt_token_ids == [1, 2, 3]


def test_a_finished_request_id_may_be_used_again():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    step(scheduler)
    scheduler.add_request(make_request("a", [4, 5, 6]))
    so = scheduler.schedule()
    assert so.finished_req_ids == ["a"]
    assert [n.prompt_token_ids for n in so.scheduled_new_reqs] == [[4, 5, 6]]


# ---- a failed step --------------------------------------------------------------------------


def test_a_failed_step_finishes_its_requests_with_error_and_frees_their_blocks():
    scheduler = make_scheduler(max_num_seqs=2)
    scheduler.add_request(make_request("a", range(10)))
    scheduler.add_request(make_request("b", range(10, 15)))
    scheduler.add_request(make_request("c", range(20, 25)))
    so = scheduler.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    failed = ModelRunnerOutput(step_id=so.step_id, req_ids=[], sampled_token_ids=[], error="boom")
    outputs = scheduler.update_from_output(so, failed)
    outs = [o for group in outputs.values() for o in group.outputs]
    assert [(o.request_id, o.finish_reason, o.error, o.new_token_ids) for o in outs] == [
        ("a", FinishReason.ERROR, "boom", []),
        ("b", FinishReason.ERROR, "boom", []),
    ]
    assert sorted(scheduler.requests) == ["c"]
    assert scheduler.kv_cache_manager.req_to_blocks == {}
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 64
    # c was not in the failed step: it goes on.
    so = scheduler.schedule()
    assert so.finished_req_ids == ["a", "b"]
    assert so.num_scheduled_tokens == {"c": 5}


# ---- outputs --------------------------------------------------------------------------------


def test_outputs_are_grouped_by_reply_subject():
    scheduler = make_scheduler()
    for rid, subject in (("a", "gw1"), ("b", "gw2"), ("c", "gw1")):
        req = make_request(rid, [1, 2, 3])
        req.reply_subject = subject
        scheduler.add_request(req)
    _, outputs = step(scheduler, {"a": 1, "b": 2, "c": 3})
    assert sorted(outputs) == ["gw1", "gw2"]
    assert [o.request_id for o in outputs["gw1"].outputs] == ["a", "c"]
    assert [o.request_id for o in outputs["gw2"].outputs] == ["b"]
    assert outputs["gw1"].scheduler_stats is None  # (the shell adds its fleet's figures, once a step)


def test_a_prefix_hit_is_reported_as_cached_tokens():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", range(10)))
    _, outputs = step(scheduler)
    assert only_output(outputs, "a").num_cached_tokens == 0
    scheduler.add_request(make_request("b", list(range(8)) + [50, 51, 52]))
    so, outputs = step(scheduler)
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8
    assert new.block_ids[:2] == [0, 1]
    assert only_output(outputs, "b").num_cached_tokens == 8
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21, 8)


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    """vLLM's cache_salt: another tenant's salt (or none) finds none of a salted prompt's
    blocks; the same salt finds them all; placement counts the same way."""
    scheduler = make_scheduler()
    prompt = list(range(20))
    cases = [("a", "tenant-1", 0), ("b", "tenant-2", 0), ("c", None, 0), ("d", "tenant-1", 16), ("e", None, 16)]
    for rid, salt, cached in cases:
        req = make_request(rid, prompt)
        req.cache_salt = salt
        scheduler.add_request(req)
        _, outputs = step(scheduler)
        assert only_output(outputs, rid).num_cached_tokens == cached, rid
    assert [scheduler.num_cached_prefix_blocks(prompt, cache_salt=s) for s in ("tenant-1", "tenant-3", None)] == [4, 0, 4]


# ---- the block leak invariant ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_a_random_workload_never_leaks_a_block(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_kv_blocks=12,
        max_num_seqs=rng.choice([3, 5, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 40]),
        long_prefill_token_threshold=rng.choice([0, 6]),
        prefix_caching=seed % 3 != 2,
    )
    prefixes = [[rng.randrange(VOCAB - 1) for _ in range(8)] for _ in range(3)]
    to_add = 40
    next_id = 0
    finished = set()
    for _ in range(2000):
        if to_add and rng.random() < 0.5:
            length = rng.randint(1, 40)
            prompt = [rng.randrange(VOCAB - 1) for _ in range(length)]
            if rng.random() < 0.5:
                prompt = (rng.choice(prefixes) + prompt)[:length]
            scheduler.add_request(
                make_request(
                    f"r{next_id}",
                    prompt,
                    max_tokens=rng.choice([1, 5, 20, None]),
                    min_tokens=rng.choice([0, 0, 1]),
                )
            )
            next_id += 1
            to_add -= 1
        if scheduler.requests and rng.random() < 0.1:
            scheduler.abort_requests([rng.choice(sorted(scheduler.requests))])
        so = scheduler.schedule()
        check_ref_counts(scheduler)
        if so.num_scheduled_tokens and rng.random() < 0.02:
            runner = ModelRunnerOutput(so.step_id, [], [], error="worker failed")
        else:
            sampled = {}
            for rid in so.num_scheduled_tokens:
                request = scheduler.requests.get(rid)
                if request is not None and request.num_computed_tokens >= request.num_tokens:
                    sampled[rid] = [EOS if rng.random() < 0.05 else rng.randrange(VOCAB)]
            if rng.random() < 0.05 and sampled:
                # An abort lands while the step is in flight.
                scheduler.abort_requests([rng.choice(sorted(sampled))])
            runner = runner_output(so, sampled)
        for group in scheduler.update_from_output(so, runner).values():
            finished.update(o.request_id for o in group.outputs if o.finish_reason is not None)
        check_ref_counts(scheduler)
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        if not to_add and not scheduler.has_unfinished_requests():
            break
    else:
        pytest.fail("the workload did not finish in 2000 steps")
    assert scheduler.num_preemptions > 0  # the cache was small enough to matter
    assert scheduler.requests == {}
    assert_all_blocks_free(scheduler)


def test_scheduler_step_times_script_times_both_halves_of_a_step():
    """scripts/scheduler_step_times.py, behind docs/performance/history.md's scheduler figures, runs
    and reports both halves for the batch asked."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "scheduler_step_times.py"
    result = subprocess.run([sys.executable, str(script), "--batch", "8", "--steps", "40", "--runs", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2 and all(r["batch"] == 8 and r["schedule_us"] > 0 and r["update_from_output_us"] > 0
                                  for r in rows)
