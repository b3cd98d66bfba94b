"""OpenTelemetry setup and W3C trace-context propagation over NATS headers.

Configured by the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`,
`OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER` and `_ARG`), or vLLM's `--otlp-traces-endpoint`
(`use_traces_endpoint`); with no endpoint set tracing is off and every span is a no-op.
Spans go over OTLP/HTTP to an `http(s)://` endpoint and over OTLP/gRPC to any other
(`grpc://host:4317` in plain text, a bare `host:4317` as vLLM's docs write it, over TLS
unless `OTEL_EXPORTER_OTLP_TRACES_INSECURE=true`), unless the protocol variable says.
"""

from __future__ import annotations

import os
import threading
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Tracer  # noqa: F401 - re-exported for services
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_provider = None
_span_exporter = None
# How long the spans left at exit may take to go out: a collector that cannot be reached
# would hold the exit for the exporter's retries (its 10 s timeout), past a service's
# shutdown limit (shared/bus.py's AFTER_CLOSE_S), which then ends the process with status 1
SHUTDOWN_FLUSH_S = 2.0


def tracing_enabled() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def setup_tracing(service: str) -> Tracer:
    """A tracer for this service; exports over OTLP/HTTP only when an endpoint is set."""
    global _provider, _span_exporter
    if tracing_enabled() and _provider is None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # OTEL_SERVICE_NAME, when set, wins inside Resource.create; the sampler comes from
        # OTEL_TRACES_SAMPLER(_ARG) through the SDK's own defaults.
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or f"llmbus-{service}"})
        _provider = TracerProvider(resource=resource)
        _span_exporter = _exporter()
        _provider.add_span_processor(BatchSpanProcessor(_span_exporter, schedule_delay_millis=500))
        trace.set_tracer_provider(_provider)
    return trace.get_tracer(f"llmbus.{service}")


def use_traces_endpoint(url: str | None) -> None:
    """vLLM's --otlp-traces-endpoint: where this process (and the services it starts)
    send their spans. An OTLP/HTTP URL without a path gets the traces path, as the
    general endpoint variable would."""
    if not url:
        return
    if url.startswith(("http://", "https://")) and urlparse(url).path in ("", "/"):
        url = url.rstrip("/") + "/v1/traces"
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = url


def _exporter():
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol is None:
        protocol = "http/protobuf" if endpoint.startswith(("http://", "https://")) else "grpc"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        # grpc:// is no scheme of OTLP's: plain text, as http:// is to the HTTP exporter
        plain = True if urlparse(endpoint).scheme == "grpc" else None
        return GrpcExporter(insecure=plain)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def shutdown_tracing(timeout_s: float = SHUTDOWN_FLUSH_S) -> None:
    """Flush what is buffered; call on the way out. Bounded: spans that cannot go out
    within `timeout_s` are dropped (the exporter's shutdown ends its retries)."""
    if _provider is None:
        return
    flushing = threading.Thread(target=_provider.shutdown, daemon=True)
    flushing.start()
    flushing.join(timeout_s)
    if flushing.is_alive():
        _span_exporter.shutdown()  # (its retries wait on this, and end)
        flushing.join(1.0)


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The `traceparent` (and `tracestate`) of a context, as NATS headers."""
    headers: dict[str, str] = {}
    _propagator.inject(headers, context=ctx)
    return headers


def extract(headers: dict[str, str] | None) -> otel_context.Context:
    return _propagator.extract(headers or {})


def span_context_of(headers: dict[str, str] | None) -> trace.SpanContext | None:
    """The remote span context carried by headers, for span links; None if absent."""
    span_context = trace.get_current_span(extract(headers)).get_span_context()
    return span_context if span_context.is_valid else None
