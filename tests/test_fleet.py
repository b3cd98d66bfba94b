"""The fleet in process: placement, drain, death, waiting with no worker, and the queue
bound, with exact request ids and clocks instead of processes and timeouts."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.scheduler.shell.fleet import Fleet
from shared.config import SchedulerConfig
from shared.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput, SchedulerStats, WorkerInfo
from shared.sampling_params import SamplingParams
from services.scheduler.shell.wakefulness import Wakefulness

BLOCK_SIZE = 4


def worker(worker_id: str, num_kv_blocks: int = 64, draining: bool = False) -> WorkerInfo:
    return WorkerInfo(worker_id, "tiny", num_kv_blocks, BLOCK_SIZE, max_model_len=1024, vocab_size=100,
                      draining=draining)


def request(request_id: str, prompt=(1, 2, 3, 4, 5, 6, 7, 8, 9), max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(prompt), SamplingParams(max_tokens=max_tokens),
                             reply_subject=f"out.{request_id}")


def make_fleet(max_num_seqs: int = 128, **options) -> Fleet:
    config = SchedulerConfig(max_model_len=512, max_num_seqs=max_num_seqs)
    return Fleet(config, heartbeat_timeout_s=2.0, no_worker_timeout_s=30.0, **options)


def owner_of(fleet: Fleet, request_id: str) -> str:
    return fleet.owner[request_id].worker_id


def test_a_request_goes_to_the_least_loaded_worker():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.heard_from(worker("w2"), now=0.0)
    assert fleet.submit(request("a"), now=0.0) == []
    assert fleet.submit(request("b", prompt=[50, 51, 52, 53, 54]), now=0.0) == []
    assert {owner_of(fleet, "a"), owner_of(fleet, "b")} == {"w1", "w2"}


def test_a_request_goes_where_its_prefix_is_cached():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.heard_from(worker("w2"), now=0.0)
    fleet.submit(request("a"), now=0.0)
    core = fleet.owner["a"].core
    step = core.schedule()  # prefill: the prompt's two full blocks are registered
    assert step.num_scheduled_tokens == {"a": 9}
    fleet.submit(request("c", prompt=[1, 2, 3, 4, 5, 6, 7, 8, 40]), now=0.0)
    # Both workers are as loaded, but only a's holds the shared 8-token prefix.
    fleet.submit(request("d", prompt=[60, 61]), now=0.0)
    assert owner_of(fleet, "c") == owner_of(fleet, "a")
    assert owner_of(fleet, "d") != owner_of(fleet, "a")


def test_a_request_goes_where_its_prefix_with_its_images_is_cached():
    """The image keys folded into the pool's block hashes are folded into placement's
    count too: the same tokens with the same image go where it is cached, with another
    image nowhere in particular (the least loaded), not after a hit that would miss."""
    from shared.block_hashes import prompt_block_hashes
    from shared.messages import ImageFeature

    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.heard_from(worker("w2"), now=0.0)
    prompt = (1, 9, 9, 9, 9, 6, 7, 8, 40)  # an image's placeholders at positions 1-4
    cat, dog = [ImageFeature("cat", 1, 4, [1])], [ImageFeature("dog", 1, 4, [1])]
    fleet.submit(msgspec.structs.replace(request("a", prompt), mm_features=cat), now=0.0)
    core = fleet.owner["a"].core
    core.schedule()  # prefill: its two full blocks registered, the cat's key in the first
    assert core.num_cached_prefix_blocks(list(prompt), None, None, cat) == 2
    assert core.num_cached_prefix_blocks(list(prompt), None, None, dog) == 0
    # (the gateways' chain for KV events, shared/block_hashes.py, is the pool's)
    assert prompt_block_hashes(prompt, BLOCK_SIZE, mm_features=cat) == core.requests["a"].block_hashes
    fleet.submit(msgspec.structs.replace(request("same", prompt), mm_features=cat), now=0.0)
    assert owner_of(fleet, "same") == owner_of(fleet, "a")
    fleet.submit(msgspec.structs.replace(request("other", prompt), mm_features=dog), now=0.0)
    assert owner_of(fleet, "other") != owner_of(fleet, "a")


def test_a_burst_sharing_a_prefix_lands_together_before_any_of_it_is_computed():
    fleet = make_fleet()
    for name in ("w1", "w2", "w3"):
        fleet.heard_from(worker(name), now=0.0)
    shared = list(range(1, 17))  # four blocks of 4
    for i in range(4):  # nothing scheduled yet: no pool caches any of it
        fleet.submit(request(f"s{i}", prompt=shared + [40 + i]), now=0.0)
    assert len({owner_of(fleet, f"s{i}") for i in range(4)}) == 1
    for i in range(6):  # unrelated prompts spread by load over the other two first
        fleet.submit(request(f"u{i}", prompt=[60 + i, 70 + i, 80 + i, 90, 91]), now=0.0)
    loads = sorted(h.core.load() for h in fleet.workers.values())
    assert loads == [3, 3, 4], loads


def test_a_salted_request_goes_where_its_own_salt_s_prefix_is_cached():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.heard_from(worker("w2"), now=0.0)
    fleet.submit(msgspec.structs.replace(request("a"), cache_salt="t1"), now=0.0)
    fleet.owner["a"].core.schedule()  # prefill: the two full blocks registered under t1's salt
    # a's worker is the busier one: only its cached prefix can draw the same salt there.
    fleet.submit(msgspec.structs.replace(request("same"), cache_salt="t1"), now=0.0)
    assert owner_of(fleet, "same") == owner_of(fleet, "a")
    # t2 finds nothing cached anywhere, so the least loaded (not a's) worker takes it.
    fleet.submit(msgspec.structs.replace(request("other"), cache_salt="t2"), now=0.0)
    assert owner_of(fleet, "other") != owner_of(fleet, "a")


def test_a_dead_worker_s_requests_move_to_the_others_with_their_tokens():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.submit(request("a"), now=0.0)
    fleet.owner["a"].core.requests["a"].append_output_token(42)  # one token already streamed
    fleet.heard_from(worker("w2"), now=1.0)
    fleet.heard_from(worker("w1"), now=1.0)
    assert fleet.check(now=2.5) == []  # w1 heard at 1.0, w2 at 1.0: both alive
    fleet.heard_from(worker("w2"), now=3.0)
    assert fleet.check(now=3.5) == []  # w1 silent for 2.5 s: dead, its request moved
    assert list(fleet.workers) == ["w2"]
    assert owner_of(fleet, "a") == "w2"
    moved = fleet.workers["w2"].core.requests["a"]
    assert moved.output_token_ids == [42] and moved.all_token_ids[-1] == 42


def test_a_draining_worker_hands_its_requests_over_and_leaves():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.heard_from(worker("w2"), now=0.0)
    fleet.submit(request("a"), now=0.0)
    leaving = owner_of(fleet, "a")
    assert fleet.heard_from(worker(leaving, draining=True), now=0.5) == []
    assert leaving not in fleet.workers
    assert owner_of(fleet, "a") != leaving


def test_with_no_worker_a_request_waits_then_ends_with_a_clear_error():
    fleet = make_fleet()
    assert fleet.submit(request("a"), now=0.0) == []
    assert fleet.num_waiting() == 1
    assert fleet.check(now=29.0) == []
    [(subject, output)] = fleet.check(now=30.5)
    assert subject == "out.a"
    assert output.finish_reason == FinishReason.ERROR
    assert "no worker became available within 30 s" in output.error
    assert fleet.num_waiting() == 0


def test_a_waiting_request_is_placed_when_a_worker_joins():
    fleet = make_fleet()
    fleet.submit(request("a"), now=0.0)
    assert fleet.heard_from(worker("w1"), now=5.0) == []
    assert owner_of(fleet, "a") == "w1"
    fleet.heard_from(worker("w1"), now=39.5)
    assert fleet.check(now=40.0) == []  # placed: no longer subject to the no-worker timeout


def test_a_request_too_long_for_the_joining_worker_is_rejected_then():
    fleet = make_fleet()
    fleet.submit(request("a", prompt=[1] * 300), now=0.0)
    [(subject, output)] = fleet.heard_from(worker("w1", num_kv_blocks=32), now=1.0)  # 128 tokens of cache
    assert subject == "out.a"
    assert output.finish_reason == FinishReason.REJECTED
    assert "context" in output.error


def test_beyond_max_waiting_requests_new_ones_are_refused_as_overloaded():
    fleet = make_fleet(max_waiting_requests=2)
    assert fleet.submit(request("a"), now=0.0) == []
    assert fleet.submit(request("b"), now=0.0) == []
    [(subject, output)] = fleet.submit(request("c"), now=0.0)
    assert (subject, output.finish_reason) == ("out.c", FinishReason.OVERLOADED)
    fleet.abort(["a"])
    assert fleet.submit(request("d"), now=0.0) == []


def test_an_abort_reaches_the_owning_core_and_the_waiters():
    fleet = make_fleet()
    fleet.submit(request("waiting"), now=0.0)
    fleet.abort(["waiting"])
    assert fleet.num_waiting() == 0
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.submit(request("a"), now=0.0)
    core = fleet.workers["w1"].core
    fleet.abort(["a"])
    assert "a" not in core.requests and "a" not in fleet.owner


def test_stats_add_up_over_workers():
    fleet = make_fleet(max_num_seqs=1)
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.heard_from(worker("w2"), now=0.0)
    fleet.submit(request("a"), now=0.0)
    fleet.submit(request("b", prompt=[50, 51, 52]), now=0.0)
    fleet.submit(request("late"), now=0.0)
    for handle in fleet.workers.values():
        handle.core.schedule()
    stats = fleet.stats()
    assert stats.num_running_reqs == 2
    assert stats.num_waiting_reqs == 1
    per_worker = [h.core.make_stats() for h in fleet.workers.values()]
    assert stats.kv_cache_usage == sum(s.kv_cache_usage for s in per_worker) / 2
    assert stats.prefix_cache_queries == sum(s.prefix_cache_queries for s in per_worker) > 0


def test_the_counts_of_a_removed_worker_stay_counted():
    """Cumulative counts only grow: a gateway takes a drop for a new scheduler and counts
    everything again (they once fell with every worker lost, and /metrics doubled)."""
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.heard_from(worker("w2"), now=0.0)
    fleet.submit(request("a"), now=0.0)
    fleet.submit(request("b", prompt=[50, 51, 52]), now=0.0)
    for handle in fleet.workers.values():
        core = handle.core
        step = core.schedule()
        [req_id] = step.num_scheduled_tokens
        core.update_from_output(step, ModelRunnerOutput(step.step_id, [req_id], [[7]]))
        core.speculation.accepted_per_pos = [2, 1] if handle.worker_id == "w2" else [1]
    before = fleet.stats()
    assert (before.num_generation_tokens, before.prefix_cache_queries) == (2, 12)
    assert before.spec_decode_num_accepted_tokens_per_pos == [3, 1]
    fleet.remove(fleet.owner["b"].worker_id, "dead")
    after = fleet.stats()
    assert (after.num_generation_tokens, after.prefix_cache_queries) == (2, 12)
    assert after.spec_decode_num_accepted_tokens_per_pos == [3, 1]
    assert (after.num_running_reqs, after.num_waiting_reqs) == (1, 1)  # gauges: b waits on the other


def test_a_request_sent_twice_is_placed_once():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    assert fleet.submit(request("a"), now=0.0) == []
    assert fleet.submit(request("a"), now=0.1) == []  # a retry: nothing new, no error
    assert list(fleet.workers["w1"].core.requests) == ["a"]


def test_a_resume_of_a_running_request_sends_again_what_its_gateway_lacks():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.submit(request("a", max_tokens=10), now=0.0)
    running = fleet.workers["w1"].core.requests["a"]
    for token in (40, 41, 42):
        running.append_output_token(token)
    resume = msgspec.structs.replace(request("a", max_tokens=10), output_token_ids=[40], resume=True)
    [(subject, output)] = fleet.submit(resume, now=1.0)
    assert (subject, output.new_token_ids, output.index) == ("out.a", [41, 42], 1)
    assert fleet.workers["w1"].core.requests["a"] is running  # it goes on, not recomputed


def test_a_resume_this_scheduler_does_not_know_is_placed_with_its_tokens():
    fleet = make_fleet(max_waiting_requests=1)
    fleet.submit(request("queued"), now=0.0)  # the queue is full for new requests
    resume = msgspec.structs.replace(request("a", max_tokens=10), output_token_ids=[40, 41], resume=True)
    assert fleet.submit(resume, now=0.0) == []  # admitted before: not refused for the queue
    fleet.heard_from(worker("w1"), now=0.0)
    placed = fleet.workers["w1"].core.requests["a"]
    assert placed.output_token_ids == [40, 41] and placed.all_token_ids[-2:] == [40, 41]


def test_a_worker_that_reconnected_to_nats_starts_afresh():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    fleet.submit(request("a"), now=0.0)
    before = fleet.workers["w1"]
    again = msgspec.structs.replace(worker("w1"), incarnation=1)
    assert fleet.heard_from(again, now=0.5) == []
    assert fleet.workers["w1"] is not before  # a new core: its first step resets the worker
    assert owner_of(fleet, "a") == "w1" and fleet.workers["w1"].core.requests["a"].num_computed_tokens == 0


def test_silence_counts_only_while_the_scheduler_was_awake_to_hear_it():
    """A scheduler the host did not run from 1.0 to 9.0 may hold unread heartbeats: a
    worker is not dead for that gap, only once it stays silent for the timeout after."""
    fleet = make_fleet()
    awake = Wakefulness(now=0.0)
    fleet.heard_from(worker("w1"), now=1.0)
    awake.tick(1.0)
    assert fleet.check(now=9.0, awake=awake) == [] and "w1" in fleet.workers  # not ticked since 1.0
    for now in (9.0, 9.5, 10.0, 10.5, 10.9):
        awake.tick(now)
    assert fleet.check(now=10.9, awake=awake) == [] and "w1" in fleet.workers
    awake.tick(11.1)
    fleet.check(now=11.1, awake=awake)
    assert "w1" not in fleet.workers  # silent for 2.1 s of being awake


def test_wakefulness_counts_silence_from_the_end_of_a_stall():
    awake = Wakefulness(stall_s=1.0, now=0.0)
    for now in (0.25, 0.5, 0.75, 1.0):
        awake.tick(now)
    assert awake.silent_for(last_heard=0.1, now=1.0) == 0.9  # awake throughout
    assert awake.silent_for(last_heard=0.1, now=5.0) == 0.0  # no tick since 1.0: a stall, or waking from one
    awake.tick(5.0)
    assert awake.awake_since == 5.0
    awake.tick(5.25)
    assert awake.silent_for(last_heard=0.1, now=5.25) == 0.25
    assert awake.silent_for(last_heard=5.1, now=5.25) == pytest.approx(0.15)  # heard since the stall


def test_an_answered_step_is_proof_of_life_for_that_handle_only():
    fleet = make_fleet()
    fleet.heard_from(worker("w1"), now=0.0)
    handle = fleet.workers["w1"]
    fleet.saw(handle, now=1.5)
    assert fleet.check(now=3.0) == [] and "w1" in fleet.workers  # 1.5 s since its step
    fleet.check(now=3.6)
    assert "w1" not in fleet.workers
    fleet.heard_from(worker("w1"), now=4.0)  # rejoins as a new handle
    fleet.saw(handle, now=5.0)  # the old handle's step says nothing of the new one
    assert fleet.workers["w1"].last_seen == 4.0


class PublishedStats:
    """A NATS client that keeps what is published on the stats subject."""

    def __init__(self, subject: str) -> None:
        self.subject, self.stats = subject, []

    async def publish(self, subject: str, data: bytes, **kwargs) -> None:
        if subject == self.subject:
            self.stats.append(msgspec.msgpack.decode(data, type=SchedulerStats))


def test_stats_go_out_at_most_every_interval_and_the_last_change_always():
    """A step or a request changes the figures: the first change goes out at once, the
    ones within STATS_INTERVAL_S of it once, after it, as they are then; no change, no
    publish."""
    from services.scheduler.shell.service import STATS_INTERVAL_S, SchedulerService
    from shared.bus import Subjects

    async def main():
        subjects = Subjects("tiny")
        nc = PublishedStats(subjects.scheduler_stats)
        service = SchedulerService(nc, subjects, SchedulerConfig(max_model_len=512))
        for i in range(5):  # (no worker: each waits, and the waiting count grows)
            service.fleet.submit(request(f"r{i}"), now=0.0)
            await service._stats_changed()
        assert [s.num_waiting_reqs for s in nc.stats] == [1]
        await asyncio.sleep(STATS_INTERVAL_S * 3)
        assert [s.num_waiting_reqs for s in nc.stats] == [1, 5]
        await service._stats_changed()  # (nothing changed since)
        await asyncio.sleep(STATS_INTERVAL_S * 3)
        assert len(nc.stats) == 2

    asyncio.run(main())
