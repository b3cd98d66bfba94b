"""Traces across every hop, and Prometheus metrics that move as they should.

The services run as separate processes with the environment compose gives them,
exporting to a real OTLP/HTTP receiver started here."""

import gzip
import http.server
import os
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from deployment import Deployment
from llmbus.deploy.serve import free_port

pytestmark = pytest.mark.timeout(300)


class OtlpReceiver:
    """Collects the spans POSTed to /v1/traces, as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope in resource_spans.scope_spans:
                        for span in scope.spans:
                            receiver.spans.append({
                                "service": attrs.get("service.name"),
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex() or None,
                                "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                                "attributes": {a.key: a.value for a in span.attributes},
                            })
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def traced(tiny_llama):
    receiver = OtlpReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    d = Deployment(str(tiny_llama), worker_args=["--max-model-len", "512", "--num-kv-blocks", "128"], env=env)
    try:
        d.wait_healthy()
        yield d, receiver
    finally:
        d.close()
        receiver.close()


def test_one_streaming_request_is_one_trace_through_every_service(traced):
    deployment, receiver = traced
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", deployment.base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert [line for line in resp.iter_lines() if line][-1] == "data: [DONE]"

    def server_span():  # the gateway's request span, which everything on the bus hangs from
        return next((s for s in receiver.spans if s["name"] == "gateway.request"), None)

    deadline = time.monotonic() + 30
    wanted = {"llmbus-gateway", "llmbus-tokenizer", "llmbus-scheduler", "llmbus-worker"}
    names = {"gateway.tokenize", "tokenizer.encode", "scheduler.queue", "gateway.stream", "scheduler.step",
             "worker.execute"}
    # Each service exports in batches every 0.5 s, so a trace arrives in pieces: wait until
    # every piece the checks read is in and nothing more has come for over two periods.
    seen, changed = -1, time.monotonic()
    while time.monotonic() < deadline:
        root = server_span()
        trace_spans = [s for s in receiver.spans if root and s["trace_id"] == root["trace_id"]]
        if len(trace_spans) != seen:
            seen, changed = len(trace_spans), time.monotonic()
        count = {n: sum(s["name"] == n for s in trace_spans) for n in ("scheduler.step", "worker.execute")}
        complete = (
            root and wanted <= {s["service"] for s in trace_spans} and names <= {s["name"] for s in trace_spans}
            and any(s["parent"] is None for s in trace_spans)  # the HTTP server span ends last
            and count["scheduler.step"] >= 5 and count["worker.execute"] == count["scheduler.step"]
        )
        if complete and time.monotonic() - changed > 1.2:
            break
        time.sleep(0.2)
    root = server_span()
    assert root is not None
    assert root["attributes"]["http.response.status_code"].int_value == 200
    spans = [s for s in receiver.spans if s["trace_id"] == root["trace_id"]]
    # FastAPI's own HTTP server span is the trace's root, with ours beneath it.
    [http_root] = [s for s in spans if s["parent"] is None]
    assert http_root["name"] == "POST /v1/completions" and http_root["service"] == "llmbus-gateway"
    ids = {s["span_id"]: s for s in spans}
    ancestor = root
    while ancestor["parent"] is not None:
        ancestor = ids[ancestor["parent"]]
    assert ancestor is http_root
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    assert wanted <= {s["service"] for s in spans}

    def only(name):
        [span] = by_name[name]
        return span

    tokenize = only("gateway.tokenize")
    assert tokenize["parent"] == root["span_id"]
    assert only("tokenizer.encode")["parent"] == tokenize["span_id"]
    assert only("scheduler.queue")["parent"] == root["span_id"]
    assert only("gateway.stream")["parent"] == root["span_id"]
    steps = by_name["scheduler.step"]
    assert len(steps) >= 5  # at least one tick per generated token
    for step in steps:
        assert step["parent"] == root["span_id"]
        assert (root["trace_id"], root["span_id"]) in step["links"]
        assert step["attributes"]["llmbus.num_requests"].int_value == 1
    step_ids = {s["span_id"] for s in steps}
    executes = by_name["worker.execute"]
    assert len(executes) == len(steps) and all(e["parent"] in step_ids for e in executes)
    for execute in executes:
        assert execute["attributes"]["llmbus.forward_ms"].double_value > 0
        assert execute["attributes"]["llmbus.sample_ms"].double_value > 0


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_move_as_they_should(traced):
    deployment, _ = traced
    url = deployment.base_url
    before = httpx.get(url + "/metrics").text
    prefix = "Paged attention keeps the KV cache in fixed-size blocks. " * 3
    for i, n in enumerate((1, 1, 1, 2)):
        resp = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prefix + str(i), "max_tokens": 4, "ignore_eos": True, "n": n})
        assert resp.status_code == 200
    after = httpx.get(url + "/metrics").text
    assert after.startswith("# HELP") or "llmbus:" in after

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    # 5 engine requests (the last request's 2 choices are 2, as vLLM counts them) of 4 tokens
    assert delta("llmbus:generation_tokens_total") == 20
    assert delta("llmbus:prompt_tokens_total") > 0
    assert delta("llmbus:request_success_total", finished_reason="length") == 5
    assert delta("llmbus:time_to_first_token_seconds_count") == 5
    assert delta("llmbus:e2e_request_latency_seconds_count") == 5
    assert delta("llmbus:request_queue_time_seconds_count") == 5
    assert delta("llmbus:inter_token_latency_seconds_count") == 15  # 3 gaps a choice
    for histogram in ("request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_inference_time_seconds", "request_time_per_output_token_seconds",
                      "request_prompt_tokens", "request_params_max_tokens"):
        assert delta(f"llmbus:{histogram}_count") == 5, histogram
    assert delta("llmbus:request_generation_tokens_sum") == 20
    assert delta("llmbus:request_params_max_tokens_sum") == 20
    assert delta("llmbus:request_params_n_count") == 4
    assert delta("llmbus:request_params_n_sum") == 5
    assert delta("llmbus:request_max_num_generation_tokens_sum") == 16
    # The scheduler's intervals lie inside the gateway's: queued + prefill before the first
    # token reached the client, prefill + decode is inference.
    queue, prefill = delta("llmbus:request_queue_time_seconds_sum"), delta("llmbus:request_prefill_time_seconds_sum")
    assert 0 < prefill and queue + prefill < delta("llmbus:time_to_first_token_seconds_sum")
    assert delta("llmbus:request_inference_time_seconds_sum") == pytest.approx(
        prefill + delta("llmbus:request_decode_time_seconds_sum"))
    assert delta("llmbus:prefix_cache_queries_total") > 0
    assert delta("llmbus:prefix_cache_hits_total") > 0  # the repeated prefix
    assert metric(after, "llmbus:num_requests_running") == 0
    assert metric(after, "llmbus:num_requests_waiting") == 0
    assert metric(after, "llmbus:worker_step_seconds_count") > 0
    # Every step its tokens: at least one a step, the decodes of 20 tokens all counted
    steps, step_tokens = delta("llmbus:iteration_tokens_total_count"), delta("llmbus:iteration_tokens_total_sum")
    assert 0 < steps <= step_tokens and step_tokens >= 20 - 5
    assert 'scheduler="' in after
    # vLLM's HTTP series (prometheus-fastapi-instrumentator's), which its dashboards' panels read
    assert delta("http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 4
    assert delta("http_request_duration_seconds_count", handler="/v1/completions", method="POST") == 4


def test_a_client_that_leaves_counts_its_unfinished_choices_as_aborted(traced):
    """vLLM's finished_reason "abort" (which vLLM itself leaves at 0: vllm-project/vllm#31503):
    a stream of two choices, left after its first chunks, counts two aborted requests and
    its prompt; it observes no latency (it has none to give)."""
    deployment, _ = traced
    url = deployment.base_url
    before = httpx.get(url + "/metrics").text
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 400, "n": 2, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # (then the client goes)

    def delta(text, name, **labels):
        return metric(text, name, **labels) - metric(before, name, **labels)

    deadline = time.monotonic() + 30
    while True:
        after = httpx.get(url + "/metrics").text
        if delta(after, "llmbus:request_success_total", finished_reason="abort") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta(after, "llmbus:request_success_total", finished_reason="abort") == 2
    assert delta(after, "llmbus:request_success_total", finished_reason="length") == 0
    assert delta(after, "llmbus:prompt_tokens_total") > 0
    assert delta(after, "llmbus:e2e_request_latency_seconds_count") == 0


@pytest.mark.parametrize("url, endpoint, exporter, plain", [
    ("http://jaeger:4318", "http://jaeger:4318/v1/traces", "http", None),  # the path a bare HTTP URL lacks
    ("https://otel.example/custom/path", "https://otel.example/custom/path", "http", None),
    ("grpc://jaeger:4317", "grpc://jaeger:4317", "grpc", True),  # plain text, as http:// is
    ("jaeger:4317", "jaeger:4317", "grpc", False),  # vLLM's docs' form: TLS unless the variable says
])
def test_otlp_traces_endpoint_picks_the_protocol_by_its_url(monkeypatch, url, endpoint, exporter, plain):
    from shared import tracing

    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
                 "OTEL_EXPORTER_OTLP_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    tracing.use_traces_endpoint(url)
    assert os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == endpoint
    made = tracing._exporter()
    assert type(made).__module__.split(".")[-2] == exporter
    if exporter == "grpc":
        assert made._insecure is plain
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # the variable wins
    assert type(tracing._exporter()).__module__.split(".")[-2] == "http"


def test_spans_a_collector_cannot_take_do_not_hold_a_service_s_exit(tmp_path):
    """An unreachable collector (a name that does not resolve) would hold the last flush
    for the exporter's retries, 10 s, past a service's shutdown limit (5 s after the bus
    closed), which then ends it with status 1 (a drained worker was seen to): the flush is
    bounded and the spans dropped."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from shared.tracing import setup_tracing, shutdown_tracing\n"
        "tracer = setup_tracing('probe')\n"
        "for i in range(50):\n"
        "    tracer.start_span(f's{i}').end()\n"
        "time.sleep(1.0)\n"  # (a first export has begun failing, and retries)
        "start = time.monotonic()\n"
        "shutdown_tracing()\n"
        "print(round(time.monotonic() - start, 2))\n"
    )
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.invalid:4318"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 4.0
