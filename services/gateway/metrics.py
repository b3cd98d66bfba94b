"""Prometheus metrics of one gateway, under vLLM's names with the `llmbus:` prefix, so
dashboards built for vLLM read them unchanged.

Scheduler-side figures arrive with every `EngineCoreOutputs` (gauges as they are,
cumulative counters as deltas) and carry a `scheduler` label; request-level figures are
what this gateway saw of its own requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.messages import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "scheduler"]
        r = self.registry
        self._model = model_name
        self.num_requests_running = Gauge("llmbus:num_requests_running", "Requests running on the engine", labels, registry=r)
        self.num_requests_waiting = Gauge("llmbus:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_cache_usage = Gauge("llmbus:kv_cache_usage_perc", "KV-cache usage, 1 = full", labels, registry=r)
        self.prefix_cache_queries = Counter("llmbus:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_cache_hits = Counter("llmbus:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r)
        self.num_preemptions = Counter("llmbus:num_preemptions", "Preemptions", labels, registry=r)
        self.worker_step = Histogram("llmbus:worker_step_seconds", "Duration of one engine step, per worker",
                                     ["model_name", "worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmbus:prompt_tokens", "Prefill tokens processed", ["model_name"], registry=r)
        self.generation_tokens = Counter("llmbus:generation_tokens", "Generated tokens", ["model_name"], registry=r)
        self.request_success = Counter("llmbus:request_success", "Finished requests", ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("llmbus:time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llmbus:inter_token_latency_seconds", "Time between streamed tokens", ["model_name"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("llmbus:e2e_request_latency_seconds", "End-to-end request latency", ["model_name"],
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("llmbus:request_queue_time_seconds", "Time waiting in the scheduler queue",
                                    ["model_name"], buckets=_E2E_BUCKETS, registry=r)
        self._last_cumulative: dict[str, tuple[int, int, int]] = {}

    def observe_stats(self, stats: SchedulerStats) -> None:
        labels = (self._model, stats.scheduler_id or "unknown")
        self.num_requests_running.labels(*labels).set(stats.num_running_reqs)
        self.num_requests_waiting.labels(*labels).set(stats.num_waiting_reqs)
        self.kv_cache_usage.labels(*labels).set(stats.kv_cache_usage)
        now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        before = self._last_cumulative.get(labels[1], (0, 0, 0))
        if any(n < b for n, b in zip(now, before)):
            before = (0, 0, 0)  # that scheduler restarted: its counts began again
        for counter, n, b in zip((self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions), now, before):
            if n > b:
                counter.labels(*labels).inc(n - b)
        self._last_cumulative[labels[1]] = now
        if stats.worker_id and stats.step_time_s > 0:
            self.worker_step.labels(self._model, stats.worker_id).observe(stats.step_time_s)

    def request_finished(self, prompt_tokens: int, generation_tokens: int, finish_reasons: list[str],
                         ttft: float | None, itls: list[float], e2e: float, queue_time: float | None) -> None:
        m = self._model
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generation_tokens)
        for reason in finish_reasons:
            self.request_success.labels(m, reason).inc()
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        for gap in itls:
            self.itl.labels(m).observe(gap)
        self.e2e.labels(m).observe(e2e)
        if queue_time is not None:
            self.queue_time.labels(m).observe(queue_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
