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


# SchedulerStats field -> (metric, help): gauges as they are, cumulative counts as deltas.
_GAUGES = {
    "num_running_reqs": ("llmbus:num_requests_running", "Requests running on the engine"),
    "num_waiting_reqs": ("llmbus:num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_cache_usage": ("llmbus:kv_cache_usage_perc", "KV-cache usage, 1 = full"),
}
_COUNTERS = {
    "prefix_cache_queries": ("llmbus:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("llmbus:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "num_preemptions": ("llmbus:num_preemptions", "Preemptions"),
}


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "scheduler"]
        r = self.registry
        self._model = model_name
        self._gauges = {f: Gauge(name, doc, labels, registry=r) for f, (name, doc) in _GAUGES.items()}
        self._counters = {f: Counter(name, doc, labels, registry=r) for f, (name, doc) in _COUNTERS.items()}
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
        self._last_counts: dict[str, dict[str, int]] = {}  # scheduler -> its counts last seen

    def observe_stats(self, stats: SchedulerStats) -> None:
        labels = (self._model, stats.scheduler_id or "unknown")
        for field, gauge in self._gauges.items():
            gauge.labels(*labels).set(getattr(stats, field))
        now = {field: getattr(stats, field) for field in self._counters}
        before = self._last_counts.get(labels[1], {})
        if any(now[f] < before.get(f, 0) for f in now):
            before = {}  # that scheduler restarted: its counts began again
        for field, counter in self._counters.items():
            if now[field] > before.get(field, 0):
                counter.labels(*labels).inc(now[field] - before.get(field, 0))
        self._last_counts[labels[1]] = now
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
