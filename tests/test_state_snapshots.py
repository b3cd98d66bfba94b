"""A hybrid model's prefix cache, on the scheduler's side (services/scheduler/core/state_snapshots.py):
which steps save a request's recurrent state, where its prefill is cut for that, which
later requests start from a save, and that a save the worker never made (its step failed,
or failed for that request) is never restored. The worker's side, and the outputs held to
transformers': tests/test_hybrid_models.py."""

from __future__ import annotations

from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.state_snapshots import StateSnapshots
from shared.config import SchedulerConfig
from test_scheduler import make_request, runner_output

BLOCK = 4


def hybrid_scheduler(slots: int = 2) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), num_kv_blocks=64, block_size=BLOCK,
                     vocab_size=100, recurrent_rows=4, recurrent_snapshot_rows=slots)


def run(scheduler: Scheduler, fail: str | None = None, error: str | None = None):
    """One step, answered as a worker would (a token for each request caught up), `fail`
    failing alone, or the whole step failing with `error`."""
    so = scheduler.schedule()
    sampled = {rid: [7] for rid in so.num_scheduled_tokens
               if scheduler.requests[rid].num_computed_tokens >= scheduler.requests[rid].num_tokens}
    out = runner_output(so, sampled)
    if fail is not None:
        out.request_errors[fail] = "failed"
    out.error = error
    scheduler.update_from_output(so, out)
    return so


def test_the_prefill_stops_at_its_last_boundary_and_saves_the_state_there():
    s = hybrid_scheduler()
    s.add_request(make_request("a", range(10, 21), max_tokens=2))  # 11 tokens: boundary 8
    first = run(s)
    assert first.num_scheduled_tokens == {"a": 8} and first.state_saves == {"a": 0} and not first.state_restores
    second = run(s)
    assert second.num_scheduled_tokens == {"a": 3} and not second.state_saves
    # The same prompt again: its first two blocks and the state after them
    s.add_request(make_request("b", range(10, 21), max_tokens=2))
    again = run(s)
    assert again.state_restores == {"b": 0} and again.scheduled_new_reqs[0].num_computed_tokens == 8
    assert again.num_scheduled_tokens["b"] == 3 and not again.state_saves  # (saved there already)
    assert s.requests["b"].num_cached_tokens == 8


def test_a_kv_hit_past_the_last_snapshot_is_cut_back_to_it():
    s = hybrid_scheduler()
    s.add_request(make_request("a", range(10, 23), max_tokens=1))  # 13 tokens: saved after 12
    run(s), run(s)
    # 17 tokens sharing all 13: KV blocks for 12 are cached, a state for 12: starts at 12
    s.add_request(make_request("b", [*range(10, 23), 1, 2, 3, 4], max_tokens=1))
    so = run(s)
    assert so.state_restores == {"b": 0} and s.requests["b"].num_cached_tokens == 12
    assert so.num_scheduled_tokens["b"] == 4 and so.state_saves == {"b": 1}  # on to its own boundary, 16
    # 13 tokens sharing 9 with a (two blocks): the KV cache has them, but no state after
    # 8, so it computes from its first token, and saves its state there too (a prefix two
    # requests share: a system prompt) besides at its own last boundary, 12; each save
    # takes the least recently used slot (a's, then b's)
    s.add_request(make_request("c", [*range(10, 19), 50, 51, 52, 53], max_tokens=1))
    so = run(s)
    assert not so.state_restores and s.requests["c"].num_cached_tokens == 0
    assert so.num_scheduled_tokens["c"] == 8 and so.state_saves == {"c": 0}
    so = run(s)
    assert so.num_scheduled_tokens["c"] == 4 and so.state_saves == {"c": 1}
    # A third request sharing those 8 finds that state
    s.add_request(make_request("d", [*range(10, 19), 60, 61], max_tokens=1))
    so = run(s)
    assert so.state_restores == {"d": 0} and so.scheduled_new_reqs[0].num_computed_tokens == 8


def test_a_save_the_worker_did_not_make_is_never_restored():
    for failure in ({"fail": "a"}, {"error": "worker died"}):
        s = hybrid_scheduler()
        s.add_request(make_request("a", range(10, 21), max_tokens=2))
        assert run(s, **failure).state_saves == {"a": 0}
        s.add_request(make_request("b", range(10, 21), max_tokens=2))
        so = run(s)
        assert not so.state_restores and so.num_scheduled_tokens["b"] == 8 and so.state_saves == {"b": 0}


def test_in_flight_saves_are_not_found_and_slots_go_least_recently_used_first():
    snapshots = StateSnapshots(2)
    a, b, c = b"a", b"b", b"c"
    slot_a = snapshots.reserve(a)
    assert snapshots.longest_hit([a], 1) == (0, None) and snapshots.has(a)  # not landed: not found
    snapshots.landed(slot_a, ok=True)
    assert snapshots.longest_hit([a], 1) == (1, slot_a)
    slot_b = snapshots.reserve(b)
    assert snapshots.reserve(c) == slot_a  # the one landed (b's is in flight)
    assert snapshots.reserve(b"d") is None  # every slot in flight
    snapshots.landed(slot_b, ok=True), snapshots.landed(slot_a, ok=True)
    assert snapshots.longest_hit([a, c], 2) == (2, slot_a) and snapshots.longest_hit([b], 1) == (1, slot_b)
    assert snapshots.longest_hit([a], 1) == (0, None)  # its slot went to c
    assert snapshots.reserve(b"e") == slot_a  # c's, used before b's last hit


def test_a_prompt_prefilled_in_chunks_stops_at_its_boundary_too():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), num_kv_blocks=64, block_size=BLOCK,
                  vocab_size=100, recurrent_rows=4, recurrent_snapshot_rows=2)
    s.add_request(make_request("a", range(10, 40), max_tokens=1))  # 30 tokens: boundary 28
    steps = [run(s) for _ in range(5)]
    assert [so.num_scheduled_tokens["a"] for so in steps] == [8, 8, 8, 4, 2]
    assert [so.state_saves for so in steps] == [{}, {}, {}, {"a": 0}, {}]


def test_a_request_waits_for_a_state_a_step_in_flight_saves_rather_than_compute_it_again():
    s = hybrid_scheduler()
    s.add_request(make_request("a", range(10, 23), max_tokens=1))  # 13 tokens: its state saved after 12
    run(s), run(s)
    # Two requests sharing a's first 8 tokens (a system prompt): no state was saved there,
    # so the first computes them and saves one; the second waits for it, not beside it
    s.add_request(make_request("b", [*range(10, 18), 50, 51, 52, 53, 54], max_tokens=1))
    s.add_request(make_request("c", [*range(10, 18), 60, 61, 62, 63, 64], max_tokens=1))
    first = s.schedule()
    assert set(first.num_scheduled_tokens) == {"b"} and first.num_scheduled_tokens["b"] == 8
    slot = first.state_saves["b"]
    second = s.schedule()  # built before the first lands (async scheduling): c still waits
    assert set(second.num_scheduled_tokens) == {"b"}
    s.update_from_output(first, runner_output(first, {}))
    s.update_from_output(second, runner_output(second, {"b": [7]}))
    third = s.schedule()
    assert third.state_restores == {"c": slot}
    assert [(r.req_id, r.num_computed_tokens) for r in third.scheduled_new_reqs] == [("c", 8)]
