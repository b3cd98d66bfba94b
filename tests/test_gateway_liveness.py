"""The scheduler's view of which gateways are alive (services/scheduler/shell/gateways.py) and
of which requests each holds, on exact clocks; served, tests/test_serve_faults.py kills
and stops a gateway under `llmbus serve`."""

from services.scheduler.shell.fleet import Fleet
from services.scheduler.shell.gateways import FORGET_DROPPED_S, Gateways
from services.scheduler.shell.wakefulness import Wakefulness
from shared.config import SchedulerConfig
from shared.messages import EngineCoreRequest, WorkerInfo
from shared.sampling_params import SamplingParams


def test_a_gateway_is_gone_once_silent_past_the_timeout_and_said_so_once():
    gateways = Gateways(timeout_s=10.0)
    gateways.heard("out.g1.a", now=0.0)
    gateways.heard("out.g2.b", now=5.0)
    assert gateways.silent(now=10.0) == []
    assert gateways.silent(now=10.5) == ["out.g1.a"]
    assert gateways.silent(now=11.0) == []  # (once)
    assert gateways.silent(now=15.5) == ["out.g2.b"]


def test_a_dropped_gateway_that_speaks_again_is_told_to_resume_once():
    gateways = Gateways(timeout_s=10.0)
    assert gateways.heard("out.g1.a", now=0.0) is False
    assert gateways.silent(now=11.0) == ["out.g1.a"]
    assert gateways.heard("out.g1.a", now=12.0) is True
    assert gateways.heard("out.g1.a", now=12.5) is False
    assert gateways.silent(now=20.0) == []  # heard again: alive


def test_a_dropped_gateway_is_forgotten_after_a_while():
    gateways = Gateways(timeout_s=10.0)
    gateways.heard("out.g1.a", now=0.0)
    gateways.silent(now=11.0)
    gateways.silent(now=11.0 + FORGET_DROPPED_S + 1)
    assert gateways.heard("out.g1.a", now=11.0 + FORGET_DROPPED_S + 2) is False


def test_silence_counts_only_while_the_scheduler_was_awake():
    """A scheduler the host did not run from 1 to 30 may hold the heartbeats unread."""
    gateways = Gateways(timeout_s=10.0)
    awake = Wakefulness(now=0.0)
    gateways.heard("out.g1.a", now=0.5)
    awake.tick(1.0)
    for tick in range(120, 161):  # a stall, then ticks every 0.25 s from 30 s: silence counts from 30
        awake.tick(tick * 0.25)
        assert gateways.silent(now=tick * 0.25, awake=awake) == []
    awake.tick(40.25)
    assert gateways.silent(now=40.25, awake=awake) == ["out.g1.a"]


def test_the_fleet_names_a_gateways_requests_placed_or_waiting_for_a_worker():
    fleet = Fleet(SchedulerConfig(max_model_len=512), heartbeat_timeout_s=2.0, no_worker_timeout_s=30.0)

    def request(request_id: str, reply_subject: str) -> EngineCoreRequest:
        return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), reply_subject=reply_subject)

    fleet.submit(request("unplaced", "out.g1.a"), now=0.0)  # no worker yet
    fleet.heard_from(WorkerInfo("w1", "tiny", 64, 4, max_model_len=1024, vocab_size=100), now=0.0)
    fleet.submit(request("a", "out.g1.a"), now=0.0)
    fleet.submit(request("b", "out.g2.b"), now=0.0)
    fleet.submit(request("c", "out.g1.a"), now=0.0)
    assert sorted(fleet.requests_of("out.g1.a")) == ["a", "c", "unplaced"]
    fleet.abort(fleet.requests_of("out.g1.a"))
    assert fleet.requests_of("out.g1.a") == []
    assert fleet.requests_of("out.g2.b") == ["b"]
