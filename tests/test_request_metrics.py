"""vLLM's request-level histograms as a gateway observes them: each choice (each engine
request) once when it finishes, each prompt's n choices once more for n and the longest,
with vLLM's buckets, so vLLM's Grafana dashboard reads them as it reads vLLM's."""

from __future__ import annotations

import re

import pytest
from finished_usage import finished_usage

from services.gateway.metrics import GatewayMetrics


def samples(metrics: GatewayMetrics) -> dict[str, float]:
    out = {}
    for line in metrics.render().decode().splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="tiny",?', "", name).replace(",}", "}").replace("{}", "")
            out[name] = float(value)
    return out


def test_each_choice_is_a_request_and_each_prompt_a_parent():
    metrics = GatewayMetrics("tiny")
    usage = finished_usage([9], [4, 3], n=2, max_tokens=16, queue_time_s=0.25, prefill_time_s=0.125)
    metrics.request_finished(usage)
    got = samples(metrics)
    assert got["llmbus:request_success_total{finished_reason=\"length\"}"] == 2
    assert got["llmbus:time_to_first_token_seconds_count"] == 2
    assert got["llmbus:e2e_request_latency_seconds_count"] == 2
    # Gaps within each choice: 3 + 2 (the gap between one choice's token and the other's is none)
    assert got["llmbus:inter_token_latency_seconds_count"] == 5
    assert got["llmbus:request_generation_tokens_count"] == 2
    assert got["llmbus:request_generation_tokens_sum"] == 7
    assert got["llmbus:request_prompt_tokens_sum"] == 18
    assert got["llmbus:request_params_max_tokens_sum"] == 32
    assert got["llmbus:request_params_n_count"] == 1
    assert got["llmbus:request_params_n_sum"] == 2
    assert got["llmbus:request_max_num_generation_tokens_count"] == 1
    assert got["llmbus:request_max_num_generation_tokens_sum"] == 4
    assert got["llmbus:request_queue_time_seconds_sum"] == pytest.approx(0.5)
    assert got["llmbus:request_prefill_time_seconds_sum"] == pytest.approx(0.25)
    decode = sum(c.decode_time_s for c in usage.choices.values())
    assert got["llmbus:request_decode_time_seconds_sum"] == pytest.approx(decode)
    assert got["llmbus:request_inference_time_seconds_sum"] == pytest.approx(0.25 + decode)
    assert got["llmbus:request_time_per_output_token_seconds_count"] == 2
    tpot = sum(c.decode_time_s / (c.num_tokens - 1) for c in usage.choices.values())
    assert got["llmbus:request_time_per_output_token_seconds_sum"] == pytest.approx(tpot)


def test_a_batch_of_prompts_is_a_parent_each():
    metrics = GatewayMetrics("tiny")
    metrics.request_finished(finished_usage([3, 5, 8], [1, 2, 6], max_tokens=None))
    got = samples(metrics)
    assert got["llmbus:request_params_n_count"] == 3
    assert got["llmbus:request_max_num_generation_tokens_sum"] == 9
    assert got["llmbus:request_prompt_tokens_sum"] == 16
    assert got["llmbus:request_params_max_tokens_count"] == 0  # none asked for
    # One token alone has no decode: its time per output token is 0, as vLLM's
    assert got["llmbus:request_time_per_output_token_seconds_bucket{le=\"0.01\"}"] >= 1


def test_buckets_are_vllm_s():
    got = samples(GatewayMetrics("tiny"))
    for name, bounds in {
        "time_to_first_token_seconds": ("0.001", "0.04", "2560.0"),
        "inter_token_latency_seconds": ("0.01", "0.025", "0.075", "80.0"),
        "request_time_per_output_token_seconds": ("0.01", "0.15", "80.0"),
        "e2e_request_latency_seconds": ("0.3", "0.8", "7680.0"),
        "request_prefill_time_seconds": ("0.3", "960.0"),
        "request_prompt_tokens": ("1.0", "2.0", "5.0", "2000.0", "1e+06"),
        "request_params_n": ("1.0", "2.0", "5.0", "10.0", "20.0"),
    }.items():
        for bound in bounds:
            assert f'llmbus:{name}_bucket{{le="{bound}"}}' in got, (name, bound)
    assert 'llmbus:inter_token_latency_seconds_bucket{le="0.005"}' not in got


# The series the panels of vLLM's Grafana dashboard query
# (examples/observability/prometheus_grafana/grafana.json), without their `vllm:` prefix.
VLLM_DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
    "prompt_tokens_total", "generation_tokens_total",
    "inter_token_latency_seconds_bucket", "inter_token_latency_seconds_sum", "inter_token_latency_seconds_count",
    "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
    "kv_cache_usage_perc", "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_success_total", "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum",
)


def test_every_series_of_vllm_s_dashboard_is_there_from_the_start():
    from shared.messages import SchedulerStats

    metrics = GatewayMetrics("tiny")
    metrics.observe_stats(SchedulerStats(scheduler_id="s1"))
    names = {name.split("{")[0] for name in samples(metrics)}
    missing = [s for s in VLLM_DASHBOARD_SERIES if "llmbus:" + s not in names]
    assert not missing, missing


def test_iteration_tokens_are_the_scheduler_s_steps_by_their_tokens():
    """vLLM's iteration_tokens_total: every step the scheduler builds, by its tokens (a
    prefill of 40 tokens, then decodes of 2, of 1), a fleet's workers added up."""
    from services.scheduler.core.scheduler import Scheduler
    from shared.config import SchedulerConfig
    from shared.messages import EngineCoreRequest, ModelRunnerOutput, SchedulerStats
    from shared.sampling_params import SamplingParams

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                          num_kv_blocks=32, block_size=16, vocab_size=100)
    for i, length in enumerate((30, 10)):
        scheduler.add_request(EngineCoreRequest(f"r{i}", list(range(1, length + 1)), SamplingParams(max_tokens=3 - i),
                                                eos_token_id=0))
    sizes = []
    while scheduler.has_work():
        step = scheduler.schedule()
        if not step.num_scheduled_tokens:
            break
        sizes.append(step.total_num_scheduled_tokens)
        ids = list(step.num_scheduled_tokens)
        scheduler.update_from_output(step, ModelRunnerOutput(step.step_id, ids, [[5]] * len(ids)))
    assert sizes == [40, 2, 1]
    one = scheduler.make_stats()
    fleet = SchedulerStats.combine([one, one])
    fleet.scheduler_id = "s1"
    metrics = GatewayMetrics("tiny")
    metrics.observe_stats(fleet)
    got = samples(metrics)
    series = 'llmbus:iteration_tokens_total_bucket{engine="0",le="%s",scheduler="s1"}'
    assert got[series % "1.0"] == 2  # the two 1-token steps
    assert got[series % "8.0"] == 4
    assert got[series % "32.0"] == 4
    assert got[series % "64.0"] == 6
    assert got[series % "+Inf"] == 6
    assert got['llmbus:iteration_tokens_total_count{engine="0",scheduler="s1"}'] == 6
    assert got['llmbus:iteration_tokens_total_sum{engine="0",scheduler="s1"}'] == 86


def test_a_report_overtaken_by_a_newer_one_counts_nothing_again_and_shards_keep_their_own():
    """A scheduler's reports can arrive out of order (its engine cores publish concurrently):
    an older one neither resets its counters nor moves its gauges; each shard's scheduler is
    its own series, and a new one on a shard replaces only that shard's."""
    from shared.messages import SchedulerStats

    metrics = GatewayMetrics("tiny")

    def queries() -> dict[str, float]:
        return {key: value for key, value in samples(metrics).items()
                if key.startswith("llmbus:prefix_cache_queries_total")}

    metrics.observe_stats(SchedulerStats(num_running_reqs=5, prefix_cache_queries=100, scheduler_id="a"))
    metrics.observe_stats(SchedulerStats(num_running_reqs=9, prefix_cache_queries=80, scheduler_id="a"))
    metrics.observe_stats(SchedulerStats(num_running_reqs=2, prefix_cache_queries=120, scheduler_id="a"))
    metrics.observe_stats(SchedulerStats(prefix_cache_queries=30, scheduler_id="b", data_parallel_rank=1))
    assert sorted(queries().values()) == [30.0, 120.0]
    assert any(k.startswith("llmbus:num_requests_running") and 'scheduler="a"' in k and v == 2.0
               for k, v in samples(metrics).items())
    metrics.observe_stats(SchedulerStats(prefix_cache_queries=7, scheduler_id="b2", data_parallel_rank=1))
    # b's shard has a new scheduler: b's gauges go (its counts stay counted), a's stay
    gauges = {k for k in samples(metrics) if k.startswith("llmbus:num_requests_running")}
    assert gauges == {'llmbus:num_requests_running{engine="0",scheduler="a"}',
                      'llmbus:num_requests_running{engine="1",scheduler="b2"}'}
    assert sorted(queries().values()) == [7.0, 30.0, 120.0]


def test_observing_a_request_s_gaps_at_once_counts_as_observing_each():
    from prometheus_client import CollectorRegistry, Histogram

    from services.gateway.metrics import observe_all

    registry = CollectorRegistry()
    one, many = (Histogram(name, "gaps", buckets=(0.001, 0.01, 0.1, 1.0), registry=registry) for name in ("a", "b"))
    gaps = [0.0005, 0.001, 0.002, 0.01, 0.5, 0.05, 2.0, 0.001, 7.0, 0.0]
    for gap in gaps:
        one.observe(gap)
    observe_all(many, gaps)
    samples = {m.name: {(s.name[1:], tuple(s.labels.items())): s.value for s in m.samples if s.name[1:] != "_created"}
               for m in registry.collect()}
    assert samples["a"].keys() == samples["b"].keys() and len(samples["a"]) == 7
    for key, value in samples["a"].items():  # (the sum to its last bits: added in another order)
        assert samples["b"][key] == (pytest.approx(value, rel=1e-12) if key[0] == "_sum" else value), key
