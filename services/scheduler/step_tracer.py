"""One span per scheduler step, linked to the requests it served rather than copied into each.

Its parent is the oldest request's context, so a request traced alone shows its whole
path (and every step's worker span) in one trace. Each request's link is parsed once and
kept on the scheduler's `Request`, so it goes when the request goes, however it ends
(finish, abort, migration).
"""

from __future__ import annotations

import time

from opentelemetry import trace

from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler
from shared.messages import ModelRunnerOutput, SchedulerOutput
from shared.tracing import Link, Tracer, extract, span_context_of

_NO_LINK = object()  # parsed, and the request carried no trace context


class StepTracer:
    def __init__(self, tracer: Tracer | None) -> None:
        self.tracer = tracer  # None: tracing is off and every span is the invalid one

    @classmethod
    def disabled(cls) -> "StepTracer":
        return cls(None)

    def start(self, scheduler: Scheduler, step: SchedulerOutput, worker_id: str) -> trace.Span:
        if self.tracer is None:
            return trace.INVALID_SPAN
        now_ns = time.time_ns()
        requests = [scheduler.requests[r] for r in step.num_scheduled_tokens if r in scheduler.requests]
        num_prefill_tokens = num_decodes = 0
        for request in requests:
            n = step.num_scheduled_tokens[request.request_id]
            before = request.num_computed_tokens - n  # the core counted this step already
            if before < request.num_prompt_tokens:
                num_prefill_tokens += n
            else:
                num_decodes += 1
            if request.queue_time_s is not None and not request.queue_time_traced:
                request.queue_time_traced = True
                queued = self.tracer.start_span(
                    "scheduler.queue", context=extract(request.trace_headers),
                    start_time=now_ns - int(request.queue_time_s * 1e9),
                )
                queued.end(end_time=now_ns)
        links = [link for r in requests if (link := _link_of(r)) is not None]
        oldest = min(requests, key=lambda r: r.queued_at, default=None)
        stats = scheduler.make_stats()
        return self.tracer.start_span(
            "scheduler.step",
            context=extract(oldest.trace_headers) if oldest else None,
            links=links,
            attributes={
                "llmbus.step_id": step.step_id,
                "llmbus.worker_id": worker_id,
                "llmbus.num_requests": len(requests),
                "llmbus.num_scheduled_tokens": step.total_num_scheduled_tokens,
                "llmbus.num_prefill_tokens": num_prefill_tokens,
                "llmbus.num_decode_requests": num_decodes,
                "llmbus.kv_cache_usage": stats.kv_cache_usage,
                "llmbus.num_preemptions": stats.num_preemptions,
            },
        )

    @staticmethod
    def end(span: trace.Span, error: str | None = None, answer: ModelRunnerOutput | None = None) -> None:
        if answer is not None and answer.num_draft_tokens and span.is_recording():
            # Speculation: the drafts verified in this step and how many were accepted.
            span.set_attribute("llmbus.num_draft_tokens", sum(answer.num_draft_tokens))
            span.set_attribute("llmbus.num_accepted_tokens", sum(
                len(sampled) - 1 for sampled, drafted in zip(answer.sampled_token_ids, answer.num_draft_tokens)
                if drafted and sampled))
        if error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        span.end()


def _link_of(request: Request) -> Link | None:
    if request.trace_link is None:
        span_context = span_context_of(request.trace_headers)
        request.trace_link = Link(span_context) if span_context is not None else _NO_LINK
    return None if request.trace_link is _NO_LINK else request.trace_link
