"""Prometheus metrics of one gateway, under vLLM's names with the `llmbus:` prefix, so
dashboards built for vLLM read them unchanged.

Scheduler-side figures arrive on the scheduler's stats subject at a steady rate (and
with every `EngineCoreOutputs`): gauges as they are, cumulative counts as deltas, under a
`scheduler` label; a scheduler not heard from for `stale_s` has its gauges dropped, so a
dead one's last figures do not linger. Request-level figures are what this gateway saw of
its own requests; generated tokens count as they are sent. Every series with known
labels exists from the start, at 0, so `absent()` alerts and rates work before traffic.

Sibling gateways (`llmbus serve --api-server-count N`, one port) answer a scrape with
the deployment's figures, whichever of them takes it (`merged`): request-level families
summed over the siblings (each saw its own requests); scheduler-side ones, which every
sibling reads from the same stats, their largest value (the longest-running sibling's,
which has counted the most of them).
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import Counter as Counter_
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric

from shared.messages import ITERATION_TOKENS_BUCKETS, MetricFamily, SchedulerStats

if TYPE_CHECKING:
    from services.gateway.generation import Usage

# vLLM's buckets, so a dashboard's or an alert's `le` bounds are there as they are in vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
# vLLM's 1-2-5 steps up to max_model_len; a gateway starts before it knows the scheduler's,
# so up to a million (vLLM's buckets are the first of these).
_TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 1_000_000)
_N_BUCKETS = (1, 2, 5, 10, 20)
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


# vLLM's HTTP series (prometheus-fastapi-instrumentator's, app.py adds them): request-level
HTTP_FAMILIES = frozenset({"http_requests", "http_request_size_bytes", "http_response_size_bytes",
                           "http_request_duration_highr_seconds", "http_request_duration_seconds"})


# SchedulerStats field -> (metric, help): gauges as they are, cumulative counts as deltas.
_GAUGES = {
    "num_running_reqs": ("llmbus:num_requests_running", "Requests running on the engine"),
    "num_waiting_reqs": ("llmbus:num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_cache_usage": ("llmbus:kv_cache_usage_perc", "KV-cache usage, 1 = full"),
}
_COUNTERS = {
    "prefix_cache_queries": ("llmbus:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("llmbus:prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "external_prefix_cache_queries": ("llmbus:external_prefix_cache_queries",
                                      "Prompt tokens looked up in the host's KV tier (--kv-offloading-size)"),
    "external_prefix_cache_hits": ("llmbus:external_prefix_cache_hits", "Prompt tokens loaded from the host's KV tier"),
    "num_preemptions": ("llmbus:num_preemptions", "Preemptions"),
    "spec_decode_num_drafts": ("llmbus:spec_decode_num_drafts", "Steps in which a request had drafts"),
    "spec_decode_num_draft_tokens": ("llmbus:spec_decode_num_draft_tokens", "Draft tokens proposed"),
    "spec_decode_num_accepted_tokens": ("llmbus:spec_decode_num_accepted_tokens", "Draft tokens accepted"),
}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"


# vLLM's finished_reason values, and ours for a request the engine failed.
FINISHED_REASONS = ("stop", "length", "abort", "error")


class GatewayMetrics:
    def __init__(self, model_name: str, stale_s: float = 5.0) -> None:
        self.registry = CollectorRegistry()
        # vLLM's engine label, a scheduler shard's rank (--data-parallel-rank), and the
        # scheduler process serving it now (a restarted one is another series)
        labels = ["model_name", "engine", "scheduler"]
        r = self.registry
        self._model = model_name
        self._gauges = {f: Gauge(name, doc, labels, registry=r) for f, (name, doc) in _GAUGES.items()}
        self._counters = {f: Counter(name, doc, labels, registry=r) for f, (name, doc) in _COUNTERS.items()}
        self._per_pos = Counter("llmbus:" + _PER_POS, "Draft tokens accepted, by position", [*labels, "position"],
                                registry=r)
        # The scheduler's steps by their tokens: its cumulative counts, rendered as they are.
        self._iteration_tokens = _IterationTokens(model_name)
        r.register(self._iteration_tokens)
        # vLLM's: one sample, its value the time it was taken, its labels the adapters now
        self.lora_info = Gauge("llmbus:lora_requests_info", "Running and waiting LoRA adapters",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self.worker_step = Histogram("llmbus:worker_step_seconds", "Duration of one engine step, per worker",
                                     ["model_name", "worker"], buckets=_STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmbus:prompt_tokens", "Prefill tokens processed", ["model_name"], registry=r)
        self.generation_tokens = Counter("llmbus:generation_tokens", "Generated tokens", ["model_name"], registry=r)
        self.request_success = Counter("llmbus:request_success", "Finished requests", ["model_name", "finished_reason"], registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram("llmbus:" + name, doc, ["model_name"], buckets=buckets, registry=r)

        # Request-level, vLLM's: each engine request (a choice) observed when it finishes,
        # its parent (a prompt's n choices) once for n and its longest choice.
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between streamed tokens", _TOKEN_GAP_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Decode time over the tokens after the first, per request", _TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting in the scheduler queue",
                                    _REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First scheduled to first token, in the scheduler", _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token", _REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Prefill time plus decode time",
                                        _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a request",
                                               _TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens a request generated",
                                                   _TOKEN_COUNT_BUCKETS)
        self.request_max_tokens = histogram("request_params_max_tokens", "The max_tokens a request asked for",
                                            _TOKEN_COUNT_BUCKETS)
        self.request_n = histogram("request_params_n", "The n a request asked for", _N_BUCKETS)
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "The most tokens one of a request's n choices generated",
            _TOKEN_COUNT_BUCKETS)
        request_histograms = (self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.prefill_time,
                              self.decode_time, self.inference_time, self.request_prompt_tokens,
                              self.request_generation_tokens, self.request_max_tokens, self.request_n,
                              self.request_max_generation_tokens)
        # What this gateway saw of its own requests: summed over siblings
        self.request_level = frozenset(m._name for m in (self.prompt_tokens, self.generation_tokens,
                                                         self.request_success, *request_histograms)) | HTTP_FAMILIES
        self._last_counts: dict[str, dict[str, int]] = {}  # scheduler -> its counts last seen
        self._last_seen: dict[str, float] = {}  # scheduler -> when its stats last came
        self._rank_of: dict[str, int] = {}  # scheduler -> its shard
        self.stale_s = stale_s
        # Each metric's one child under this model, looked up once: `labels()` costs more than
        # the observation it precedes, and the inter-token gaps are observed for every token.
        self._one = {metric: metric.labels(model_name) for metric in (self.prompt_tokens, self.generation_tokens,
                                                                      *request_histograms)}
        self._success = {reason: self.request_success.labels(model_name, reason) for reason in FINISHED_REASONS}
        # scheduler -> its gauges' and counters' children, by field
        self._children: dict[str, tuple[dict, dict]] = {}

    def observe_stats(self, stats: SchedulerStats) -> None:
        scheduler = stats.scheduler_id or "unknown"
        labels = (self._model, str(stats.data_parallel_rank), scheduler)
        if scheduler not in self._last_seen:
            # One scheduler serves a shard (--data-parallel-rank): a new one replaced the
            # shard's one before, whose figures are gone with it.
            self._drop([s for s, rank in self._rank_of.items() if rank == stats.data_parallel_rank])
            self._rank_of[scheduler] = stats.data_parallel_rank
            # Its children, looked up once (its counters at 0 from the first sight of it)
            self._children[scheduler] = ({f: g.labels(*labels) for f, g in self._gauges.items()},
                                         {f: c.labels(*labels) for f, c in self._counters.items()})
        self._last_seen[scheduler] = time.monotonic()
        now = {field: getattr(stats, field) for field in self._counters}
        now.update({(_PER_POS, pos): n for pos, n in enumerate(getattr(stats, _PER_POS))})
        before = self._last_counts.get(scheduler, {})
        if any(now[f] < before.get(f, 0) for f in now):
            # An older report overtaken by a newer one (a scheduler's engine cores publish
            # concurrently, and its stats subject beside the outputs): a scheduler's counts
            # never go back (a restarted one has a new id), so it says nothing new.
            return
        gauges, counters = self._children[scheduler]
        for field, gauge in gauges.items():
            gauge.set(getattr(stats, field))
        for key, value in now.items():
            if value > before.get(key, 0):
                counter = counters[key] if isinstance(key, str) else self._per_pos.labels(*labels, str(key[1]))
                counter.inc(value - before.get(key, 0))
        self._last_counts[scheduler] = now
        self._iteration_tokens.by_scheduler[scheduler] = (labels[1], stats.iteration_tokens_by_bucket,
                                                          stats.iteration_tokens_sum)
        if stats.max_lora:
            self.lora_info.clear()
            self.lora_info.labels(str(stats.max_lora), ",".join(stats.waiting_lora_adapters),
                                  ",".join(stats.running_lora_adapters)).set(time.time())
        if stats.worker_id and stats.step_time_s > 0:
            self.worker_step.labels(self._model, stats.worker_id).observe(stats.step_time_s)

    def tokens_generated(self, num_tokens: int) -> None:
        self._one[self.generation_tokens].inc(num_tokens)

    def request_finished(self, usage: Usage) -> None:
        """A generation request that ran to its end: its prompt and each choice's end, and
        vLLM's request-level histograms, each choice observed as vLLM observes each of a
        parent's engine requests."""
        self.request_ended(usage.prompt_tokens, usage.finish_reasons)
        longest: dict[int, int] = {}  # parent (prompt) -> its choices' most tokens
        for index, choice in usage.choices.items():
            if choice.finish_reason is None:
                continue
            parent = index // usage.n
            longest[parent] = max(longest.get(parent, 0), choice.num_tokens)
            if choice.first_token_at is not None:
                self._one[self.ttft].observe(choice.first_token_at - usage.started_at)
            observe_all(self._one[self.itl], choice.itls)
            self._one[self.e2e].observe(choice.finished_at - usage.started_at)
            if choice.queue_time_s is not None:
                self._one[self.queue_time].observe(choice.queue_time_s)
            decode = choice.decode_time_s
            self._one[self.decode_time].observe(decode)
            if choice.prefill_time_s is not None:
                self._one[self.prefill_time].observe(choice.prefill_time_s)
                self._one[self.inference_time].observe(choice.prefill_time_s + decode)
            self._one[self.tpot].observe(decode / (choice.num_tokens - 1) if choice.num_tokens > 1 else 0.0)
            self._one[self.request_prompt_tokens].observe(choice.prompt_tokens)
            self._one[self.request_generation_tokens].observe(choice.num_tokens)
            if usage.max_tokens:
                self._one[self.request_max_tokens].observe(usage.max_tokens)
        for most in longest.values():
            self._one[self.request_n].observe(usage.n)
            self._one[self.request_max_generation_tokens].observe(most)

    def request_served(self, prompt_lengths: list[int], finish_reasons: list[str], e2e: float,
                       queue_time: float | None) -> None:
        """A request answered whole rather than token by token (embeddings, a beam
        search): its prompts, its ends, its latency."""
        self.request_ended(sum(prompt_lengths), finish_reasons)
        self._one[self.e2e].observe(e2e)
        if queue_time is not None:
            self._one[self.queue_time].observe(queue_time)
        for length in prompt_lengths:
            self._one[self.request_prompt_tokens].observe(length)

    def request_ended(self, prompt_tokens: int, finish_reasons: list[str]) -> None:
        """Its prompt's tokens and each choice's end, by reason: every request that ran, a
        finished one's (`request_finished`) or one whose client left first ("abort" for its
        choices not done then, and no latency: it has none to observe)."""
        m = self._model
        self._one[self.prompt_tokens].inc(prompt_tokens)
        for reason in finish_reasons:
            success = self._success.get(reason)
            (success or self.request_success.labels(m, reason)).inc()

    def render(self) -> bytes:
        self._drop_stale(time.monotonic())
        return generate_latest(self.registry)

    def families(self) -> bytes:
        """This gateway's figures as a sibling is sent them (`merged`)."""
        return _families.encode(self._collected())

    def merged(self, siblings: list[bytes]) -> bytes:
        """The exposition of this gateway's figures and its siblings' (`families`) as one."""
        everyone = [self._collected()]
        for data in siblings:
            try:
                everyone.append(_families_decoder.decode(data))
            except msgspec.DecodeError:
                continue
        merged: dict[str, tuple[MetricFamily, dict]] = {}  # name -> (family, (sample, labels) -> value)
        for family in (f for families in everyone for f in families):
            into = merged.setdefault(family.name, (family, {}))[1]
            add = family.name in self.request_level
            for name, labels, value in family.samples:
                key = (name, tuple(sorted(labels.items())))
                if key not in into:
                    into[key] = value
                elif name.endswith("_created"):  # (when the series began: the earliest)
                    into[key] = min(into[key], value)
                else:
                    into[key] = into[key] + value if add else max(into[key], value)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected([_metric(family, samples) for family, samples in merged.values()]))
        return generate_latest(registry)

    def _collected(self) -> list[MetricFamily]:
        self._drop_stale(time.monotonic())
        return [MetricFamily(f.name, f.documentation, f.type, [(s.name, s.labels, s.value) for s in f.samples])
                for f in self.registry.collect()]

    def _drop_stale(self, now: float) -> None:
        self._drop([s for s, seen in self._last_seen.items() if now - seen > self.stale_s])

    def _drop(self, schedulers: list[str]) -> None:
        if schedulers:
            self.lora_info.clear()  # (the one sample is the deployment's scheduler's)
        for scheduler in schedulers:
            for gauge in self._gauges.values():
                gauge.remove(self._model, str(self._rank_of.get(scheduler, 0)), scheduler)
            self._iteration_tokens.by_scheduler.pop(scheduler, None)
            self._children.pop(scheduler, None)
            self._last_seen.pop(scheduler, None)
            self._rank_of.pop(scheduler, None)


def observe_all(histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for each value, its buckets and sum bumped once each (a
    request's inter-token gaps: one a token, observed when it ends). Reads the child's
    bounds and values as prometheus-client 0.26 (pinned) lays them out: a bucket counts the
    values above the bound before it, up to its own."""
    if not values:
        return
    bounds = histogram._upper_bounds
    counts = Counter_(bisect.bisect_left(bounds, v) for v in values)
    for i, n in counts.items():
        histogram._buckets[i].inc(n)
    histogram._sum.inc(math.fsum(values))


_families = msgspec.msgpack.Encoder()
_families_decoder = msgspec.msgpack.Decoder(list[MetricFamily])


def _metric(family: MetricFamily, samples: dict) -> Metric:
    metric = Metric(family.name, family.documentation, family.type)
    for (name, labels), value in samples.items():
        metric.add_sample(name, dict(labels), value)
    return metric


class _Collected:
    """A registry's collector of families already merged."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self):
        return self.metrics


class _IterationTokens:
    """vLLM's iteration_tokens_total: a histogram the scheduler counts (it sees every
    step), which a gateway renders from its latest stats rather than observes."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.by_scheduler: dict[str, tuple[str, list[int], int]] = {}  # -> (engine, steps by bucket, tokens)

    def collect(self):
        family = HistogramMetricFamily("llmbus:iteration_tokens_total", "Tokens per engine step",
                                       labels=["model_name", "engine", "scheduler"])
        for scheduler, (engine, by_bucket, tokens) in self.by_scheduler.items():
            counts = list(by_bucket) + [0] * (len(ITERATION_TOKENS_BUCKETS) + 1 - len(by_bucket))
            cumulative = list(itertools.accumulate(counts))
            buckets = [(str(float(b)), c) for b, c in zip(ITERATION_TOKENS_BUCKETS, cumulative)]
            family.add_metric([self.model_name, engine, scheduler], buckets + [("+Inf", cumulative[-1])], tokens)
        yield family


class OwnMetrics:
    """/metrics of this gateway alone (shell/sibling_metrics.py merges its siblings' on a shared port)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def exposition(self) -> bytes:
        return self.metrics.render()
