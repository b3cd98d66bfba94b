"""`llmbus serve` starts a whole deployment, serves (`llmbus bench serve` included), takes
a restarted worker back as a new one, and leaves no process behind on SIGTERM."""

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from deployment import completion_texts, llmbus_serve
from llmbus.deploy.serve import live_children

pytestmark = pytest.mark.timeout(300)


# A chat template of the deployment's own (vLLM's --chat-template), unlike the model's.
CHAT_TEMPLATE = "{% for m in messages %}### {{ m.role }} says:\n{{ m.content }}\n{% endfor %}### assistant says:\n"


class GrpcTraceReceiver:
    """An OTLP/gRPC trace collector: the service.name of every span it is sent."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.services: list[str] = []
        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                for resource_spans in request.resource_spans:
                    attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    count = sum(len(scope.spans) for scope in resource_spans.scope_spans)
                    receiver.services += [attrs.get("service.name")] * count
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


@pytest.fixture(scope="module")
def traces():
    receiver = GrpcTraceReceiver()
    yield receiver
    receiver.server.stop(0)


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory, traces):
    import shutil

    folder = tmp_path_factory.mktemp("serve")
    (folder / "chat.jinja").write_text(CHAT_TEMPLATE)
    # The checkpoint without its tokenizer's files, which vLLM's --tokenizer names elsewhere:
    # the gateway, the tokenizers and the worker's grammars read them from there.
    bare = folder / "weights-only"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, bare / name)
    # Some flags from vLLM's --config file (the command line wins: --num-kv-blocks 64).
    (folder / "serve.yaml").write_text("num-kv-blocks: 8\nkv-cache-dtype: fp8_e5m2\ntrust-remote-code: true\n"
                                       "enable-prefix-caching: true\nseed: 0\n")
    proc, url = llmbus_serve(
        # As a vLLM user types it: the model first, and vLLM's flags that change nothing here.
        [str(bare), "--tokenizer", str(tiny_llama), "--config", str(folder / "serve.yaml"), "--served-model-name", "tiny", "gpt-4o-mini",
         "--tokenizers", "2", "--num-kv-blocks", "64", "--chat-template", str(folder / "chat.jinja"),
         "--enable-tokenizer-info-endpoint", "-tp", "1", "--hf-overrides", '{"max_position_embeddings": 512}',
         "--enable-auto-tool-choice", "--disable-log-stats", "--disable-log-requests", "--uvicorn-log-level", "info",
         "--otlp-traces-endpoint", f"grpc://127.0.0.1:{traces.port}", "--collect-detailed-traces", "all", "-v"],
        folder / "stderr.log",
        # A worker restarted by the supervisor is always back before the scheduler would
        # miss its heartbeats (test_a_restarted_worker_...).
        env={"LLMBUS_HEARTBEAT_TIMEOUT": "60"},
    )
    yield proc, url, psutil.Process(proc.pid).children(recursive=True)
    if proc.poll() is None:
        proc.kill()


def test_serve_starts_everything_and_answers(served):
    _, url, children = served
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert "nats-server" in names
    for service in ("scheduler", "worker", "gateway"):
        assert f"llmbus {service}" in names
    assert names.count("llmbus tokenizer") == 2
    worker = next(c for c in children if "llmbus worker" in " ".join(c.cmdline()))
    # The worker's flags reach it, as the LLMBUS_* variables its flags default to (a float8
    # cache serves below), the --config file's (the cache's dtype) and the command line's
    # over the file's (its blocks).
    assert worker.environ()["LLMBUS_KV_CACHE_DTYPE"] == "fp8_e5m2"
    assert worker.environ()["LLMBUS_NUM_KV_BLOCKS"] == "64"
    resp = httpx.post(f"{url}/v1/completions",
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] >= 1
    # vLLM's --hf-overrides: every service reads the config as overridden (the context, 1024)
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert models[0]["max_model_len"] == 512


def test_vllms_otlp_traces_endpoint_gets_every_services_spans_over_grpc(served, traces):
    """vLLM's --otlp-traces-endpoint (its default protocol, gRPC): one request's spans
    from each service that served it."""
    _, url, _ = served
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert resp.status_code == 200
    wanted = {"llmbus-gateway", "llmbus-tokenizer", "llmbus-scheduler", "llmbus-worker"}
    deadline = time.monotonic() + 20  # (each exports its batch within half a second)
    while not wanted <= set(traces.services) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert wanted <= set(traces.services), sorted(set(traces.services))


def test_v_logs_every_service_at_info_each_having_frozen_its_heap(served):
    """`llmbus serve -v` reaches every service it starts, and each of them froze its
    start-up heap once ready (shared/gc_heap.py), the two tokenizer replicas included."""
    proc, _, _ = served
    log = proc.log.read_text()
    for service, count in (("scheduler", 1), ("gateway", 1), ("tokenizer", 2)):
        assert log.count(f"{service} froze its start-up heap") == count, service
    assert log.count("worker froze its start-up heap") >= 1  # (again when a test below restarts it)
    assert '"logger": "llmbus.worker"' in log and '"level": "INFO"' in log


def test_the_chat_template_of_the_command_line_renders_chats(served, tiny_llama):
    """Both tokenizer replicas render with --chat-template (a chat's prompt tokens are its
    rendering's, not the model's template's), and /tokenizer_info shows it."""
    from services.tokenizer.tokenizer import Tokenizer

    _, url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    messages = [{"role": "user", "content": "what is two and two"}]
    own = len(Tokenizer(tiny_llama, chat_template=CHAT_TEMPLATE).apply_chat_template(messages))
    assert own != len(Tokenizer(tiny_llama).apply_chat_template(messages))
    for name in ("tiny", "gpt-4o-mini") * 2:  # over both replicas (a queue group); by either served name
        answer = client.chat.completions.create(model=name, messages=messages, max_tokens=2)
        assert answer.usage.prompt_tokens == own and answer.model == "tiny"  # (the first name answers, as vLLM's)
    assert httpx.get(f"{url}/tokenizer_info", timeout=10).json()["chat_template"] == CHAT_TEMPLATE


def test_vllms_logging_flags_reach_the_gateway(served):
    """--disable-log-requests: no line per finished request; --uvicorn-log-level info:
    uvicorn's access log, a line per HTTP request."""
    proc, url, _ = served
    httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2}, timeout=60)
    deadline = time.monotonic() + 10
    while "POST /v1/completions" not in proc.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = proc.log.read_text()
    assert "POST /v1/completions" in log
    assert "request finished" not in log


def test_bench_serve_compares_served_and_offline_in_pairs(served, tiny_llama):
    proc, url, _ = served
    posts_before = proc.log.read_text().count("POST /v1/completions")
    result = subprocess.run(
        [sys.executable, "-m", "llmbus", "bench", "serve", "--base-url", url,
         "--model", "tiny", "--num-requests", "4", "--concurrency", "2", "--input-len", "4", "8",
         "--output-len", "3", "5", "--vocab-size", "300", "--service-cpu",
         "--compare-offline", str(tiny_llama), "--offline-kv-cache-memory-gb", "0.01", "--repeat", "2",
         "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05"],  # (both sides sample so)
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    pairs = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(pairs) == 2
    for pair in pairs:
        assert pair["completed"] == 4 and pair["failed"] == 0
        # ignore_eos: exactly max_tokens each, served and offline alike
        assert pair["output_tokens"] == pair["offline"]["output_tokens"] >= 4 * 3
        assert {"client", "gateway", "scheduler", "worker", "nats", "machine"} <= set(pair["service_cores"])
    assert lines[-1].startswith("over 2 pairs") and "served/offline" in lines[-1]
    # Each run's requests and, before its clock starts, vLLM's initial single-prompt test run.
    assert proc.log.read_text().count("POST /v1/completions") - posts_before == 2 * (4 + 1)


def test_bench_serve_sends_its_sampling_flags(served):
    """An invalid top-p comes back as the server's 400 naming it: the flag reached the request."""
    _, url, _ = served
    result = subprocess.run(
        [sys.executable, "-m", "llmbus", "bench", "serve", "--base-url", url, "--model", "tiny",
         "--num-requests", "2", "--input-len", "4", "8", "--output-len", "3", "5", "--vocab-size", "300",
         "--top-p", "1.5"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0 and "initial test run failed: HTTP 400" in result.stderr
    assert "top_p" in result.stderr


def test_bench_serve_compares_structured_and_plain_on_the_same_lengths(served):
    _, url, _ = served
    result = subprocess.run(
        [sys.executable, "-m", "llmbus", "bench", "serve", "--base-url", url, "--model", "tiny",
         "--num-requests", "4", "--concurrency", "2", "--input-len", "4", "8", "--output-len", "6", "9",
         "--vocab-size", "300", "--compare-structured", "--repeat", "2"],
        capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    pairs = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(pairs) == 2 and list(pairs[0])[:2] == ["plain", "structured"] and list(pairs[1])[:2] == [
        "structured", "plain"]
    for pair in pairs:
        # The schema cannot end early: both sides generate every max_tokens.
        assert pair["plain"]["output_tokens"] == pair["structured"]["output_tokens"] >= 4 * 6
        assert pair["structured"]["failed"] == 0
    assert lines[-1].startswith("over 2 pairs") and "structured/plain" in lines[-1]


def test_only_the_workers_load_torch(served):
    """`llmbus`'s parser once imported torch through the benchmarks, in every process:
    seconds of start-up and ~200 MB each; the gateway and tokenizers then loaded it with
    transformers' tokenizer. Only a worker needs it (and a tokenizer's grammar-check
    child, a process of its own)."""
    proc, _, children = served

    def loads_torch(process: psutil.Process) -> bool:
        return any("libtorch" in m.path for m in process.memory_maps())

    by_service = {}
    for child in children:
        argv = child.cmdline()
        if argv[1:3] == ["-m", "llmbus"]:
            by_service.setdefault(argv[3], set()).add(loads_torch(child))
    assert not loads_torch(psutil.Process(proc.pid))
    assert by_service["scheduler"] == by_service["gateway"] == by_service["tokenizer"] == {False}
    assert by_service["worker"] == {True}


def test_a_restarted_worker_is_a_new_one_and_its_streams_go_on_at_once(served):
    """The supervisor restarts a killed worker under its old id (its bus identity). Back
    before the scheduler misses its heartbeats (60 s here), it must still be taken as a
    new worker, its streams resumed on it from their tokens: it once announced itself as
    the old one, alive, and the scheduler waited out the dead one's step (120 s)."""
    proc, url, _ = served
    prompts = [f"restart {i}: the quick brown fox" for i in range(4)]
    request = {"model": "tiny", "max_tokens": 300, "temperature": 0, "extra_body": {"ignore_eos": True}}
    expected = completion_texts(url, prompts, **request)
    victim = live_children(proc.pid, "worker")[0]
    unfinished_at_kill = []

    async def stream_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        texts = [""] * len(prompts)
        done = set()

        async def one(i: int) -> None:
            stream = await client.completions.create(prompt=prompts[i], stream=True, **request)
            async for chunk in stream:
                texts[i] += chunk.choices[0].text
                if all(texts) and not unfinished_at_kill:
                    unfinished_at_kill.append(len(prompts) - len(done))
                    victim.kill()
            done.add(i)

        try:
            await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await client.close()
        return texts

    assert asyncio.run(stream_all()) == expected
    assert unfinished_at_kill[0] > 0  # (streams were cut)
    assert [w.pid for w in live_children(proc.pid, "worker")] not in ([], [victim.pid])


def test_a_request_sent_while_the_gateway_restarts_waits_for_it_and_is_answered(served):
    """The port is `llmbus serve`'s own socket, handed to every gateway it starts: while a
    killed gateway restarts, a client's connection waits in the backlog and its request is
    answered by the new gateway, where it was refused before."""
    proc, url, _ = served
    victim = live_children(proc.pid, "gateway")[0]
    victim.kill()
    victim.wait(10)  # (closed, its sockets with it: reaped, or a zombie until the supervisor reaps it)
    resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
                      timeout=120)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert [g.pid for g in live_children(proc.pid, "gateway")] not in ([], [victim.pid])


def test_api_server_count_serves_one_port_with_sibling_gateways(tiny_llama, tmp_path):
    """vLLM's --api-server-count 2: two gateways on the port, each answering requests; a
    scrape of /metrics, whichever takes it, counts every request; a conversation stored by
    either goes on at either; one killed, the other serves on while it restarts."""
    proc, url = llmbus_serve(["--model", str(tiny_llama), "--served-model-name", "tiny", "--api-server-count", "2"],
                             tmp_path / "stderr.log")
    try:
        gateways = live_children(proc.pid, "gateway")
        assert len(gateways) == 2
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stored = client.responses.create(model="tiny", input="hi", max_output_tokens=3)
        for _ in range(8):  # (new connections: the kernel hands each to a gateway)
            with httpx.Client() as fresh:
                assert fresh.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                  timeout=60).status_code == 200
                more = fresh.post(f"{url}/v1/responses", timeout=60, json={
                    "model": "tiny", "input": "more", "previous_response_id": stored.id, "max_output_tokens": 2})
                assert more.status_code == 200, more.text
        time.sleep(1.0)  # (each has heard the other's heartbeat)

        def finished() -> list[float]:
            scrapes = []
            for _ in range(4):
                with httpx.Client() as fresh:
                    text = fresh.get(f"{url}/metrics", timeout=30).text
                scrapes.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                   if line.startswith("llmbus:request_success_total{")))
            return scrapes

        assert finished() == [17.0] * 4  # 1 + 8 + 8, whichever gateway was scraped
        with httpx.Client() as fresh:  # (vLLM's HTTP series, summed over the siblings as the rest)
            text = fresh.get(f"{url}/metrics", timeout=30).text
        assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('http_requests_total{handler="/v1/completions"')) == 8
        gateways[0].kill()
        gateways[0].wait(10)
        for _ in range(4):
            with httpx.Client() as fresh:
                assert fresh.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                  timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_a_port_another_server_holds_is_one_line_and_nothing_starts(tiny_llama):
    """Where another server listens on --port, `llmbus serve` says so and exits at once: it
    once started everything, said it was serving (that server's /health answered) and gave
    up after its gateway failed five restarts."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "llmbus", "serve", "--model", str(tiny_llama), "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (f"llmbus: error: cannot listen on 127.0.0.1:{port}: Address already in use "
                                   "(--port chooses another)")


@pytest.mark.parametrize("host, https, url", [("127.0.0.1", False, "http://127.0.0.1:8000"),
                                              ("::1", False, "http://[::1]:8000"), ("::", True, "https://[::]:8000"),
                                              ("localhost", True, "https://localhost:8000")])
def test_the_url_serve_waits_on_and_prints_writes_an_ipv6_host_in_brackets(host, https, url):
    """(--host :: once gave http://:::8000, which /health could never answer at.)"""
    from llmbus.deploy.serve import base_url

    assert base_url(host, 8000, https) == url


def test_ctrl_c_during_start_up_stops_everything_without_serving(tiny_llama, tmp_path):
    """A Ctrl-C while the services start (a big model's load may last minutes) stops
    them then: `llmbus serve` once waited for the deployment to be up, said it was
    serving, and only then stopped."""
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "llmbus", "serve", "--model", str(tiny_llama),
                                 "--port", "0"], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 60
        while not live_children(proc.pid, "worker"):  # (started, not yet up: its model loads)
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "is serving" not in out
    assert "Traceback" not in log.read_text()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        time.sleep(0.1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_stops_everything(served):
    proc, _, _ = served
    children = psutil.Process(proc.pid).children(recursive=True)  # (a restarted worker among them)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        time.sleep(0.1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
