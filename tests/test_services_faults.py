"""How the services behave when a part stops answering: errors that come quickly, never hangs."""

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from deployment import Deployment

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def deployment(tiny_llama):
    d = Deployment(str(tiny_llama), worker_args=["--max-model-len", "512", "--num-kv-blocks", "128"],
                   scheduler_args=["--step-timeout", "2", "--no-worker-timeout", "4"])
    try:
        d.wait_healthy()
        yield d
    finally:
        for proc in d.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        d.close()


def complete(deployment, max_tokens=8, timeout=60):
    return httpx.post(deployment.base_url + "/v1/completions", timeout=timeout, json={
        "model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_a_worker_that_stops_answering_and_comes_back_finishes_the_request(deployment):
    expected = complete(deployment).json()["choices"][0]["text"]
    worker = deployment.procs["worker"]
    os.kill(worker.pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = pool.submit(complete, deployment)
        time.sleep(3.0)  # past the 2 s step deadline and heartbeat timeout: declared dead
        health = httpx.get(deployment.base_url + "/health", timeout=10)
        assert health.status_code == 503 and "no worker" in health.json()["reason"]
        # A request that arrives while no worker is known (the gateway now knows no
        # context length either) waits too, as one does before the first worker joins.
        # (The scheduler's --no-worker-timeout of 4 s runs from the first request's arrival.)
        late = pool.submit(complete, deployment)
        time.sleep(0.3)  # the gateway used to refuse at once: "context is 0 tokens"
        assert not pending.done(), pending.result().text
        assert not late.done(), late.result().text  # they wait for a worker rather than failing
        os.kill(worker.pid, signal.SIGCONT)  # it speaks again: rejoins, resets, recomputes
        resp, late_resp = pending.result(timeout=60), late.result(timeout=60)
    for r in (resp, late_resp):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
    assert deployment.stats()["kv_cache_usage"] == 0


def test_with_no_worker_a_request_ends_with_a_clear_error_in_bounded_time(deployment):
    worker = deployment.procs["worker"]
    os.kill(worker.pid, signal.SIGSTOP)
    start = time.monotonic()
    resp = complete(deployment)
    elapsed = time.monotonic() - start
    os.kill(worker.pid, signal.SIGCONT)
    assert resp.status_code == 500
    assert "no worker became available" in resp.json()["error"]["message"]
    assert elapsed < 20
    # Once the worker is back, the same deployment serves again.
    deployment.wait_healthy()
    assert complete(deployment).status_code == 200


def test_health_is_503_while_the_scheduler_is_down(deployment):
    deployment.procs["scheduler"].send_signal(signal.SIGTERM)
    deployment.procs["scheduler"].wait(30)
    del deployment.procs["scheduler"]
    resp = httpx.get(deployment.base_url + "/health", timeout=10)
    assert resp.status_code == 503
    assert "scheduler" in resp.json()["reason"]
    completion = httpx.post(deployment.base_url + "/v1/completions",
                            json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=30)
    assert completion.status_code == 503
    assert completion.json()["error"]["type"] == "service_unavailable"


def test_a_full_waiting_queue_answers_429_with_retry_after(tiny_llama):
    d = Deployment(str(tiny_llama), worker_args=["--max-model-len", "512", "--num-kv-blocks", "128"],
                   scheduler_args=["--max-num-seqs", "1", "--max-waiting-requests", "2"])
    try:
        d.wait_healthy()
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(
                lambda _: httpx.post(d.base_url + "/v1/completions", json=body, timeout=120), range(10)))
        codes = sorted(r.status_code for r in responses)
        assert 429 in codes and 200 in codes
        assert set(codes) == {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        stream = httpx.post(d.base_url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        assert stream.status_code == 200  # the queue drained: served again
    finally:
        d.close()


# Across a scheduler restart: greedy, seeded sampling and penalties each carry on exactly.
RESTART_BODIES = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 7},
    "penalized": {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.2},
}


def stream_text(base_url: str, body: dict, progress: list) -> tuple[str, list]:
    """The streamed text and any error events; `progress` gets one entry per chunk."""
    text, errors = "", []
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
                continue
            text += event["choices"][0]["text"]
            progress.append(1)
    return text, errors


def test_a_scheduler_killed_mid_stream_and_restarted_loses_no_token(tiny_llama):
    d = Deployment(str(tiny_llama), worker_args=["--max-model-len", "1024", "--num-kv-blocks", "256"])
    try:
        d.wait_healthy()
        base = {"model": "tiny", "prompt": "a long story", "max_tokens": 400, "ignore_eos": True}
        bodies = {name: {**base, **params} for name, params in RESTART_BODIES.items()}
        progress = {name: [] for name in bodies}
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            expected = dict(zip(bodies, pool.map(lambda body: httpx.post(  # (batched, as the streams below are)
                d.base_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"], bodies.values())))
            futures = {name: pool.submit(stream_text, d.base_url, body, progress[name]) for name, body in bodies.items()}
            deadline = time.monotonic() + 60
            while min(len(p) for p in progress.values()) < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            d.procs["scheduler"].kill()
            at_kill = {name: len(p) for name, p in progress.items()}
            d.procs["scheduler"].wait(10)
            d.start("scheduler", ["scheduler", "--nats-url", d.nats.url, "--model", d.model, "--served-model-name", "tiny"])
            results = {name: f.result(timeout=120) for name, f in futures.items()}
        for name, (text, errors) in results.items():
            assert errors == [], name
            assert text == expected[name], name
            assert len(progress[name]) > at_kill[name], f"{name} had ended before the kill"
    finally:
        d.close()


def test_a_scheduler_that_does_not_come_back_ends_the_streams_in_bounded_time(tiny_llama):
    d = Deployment(str(tiny_llama), worker_args=["--max-model-len", "1024", "--num-kv-blocks", "256"],
                   gateway_args=["--scheduler-resume-timeout", "2"])
    try:
        d.wait_healthy()
        body = {"model": "tiny", "prompt": "a long story", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", d.base_url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            d.procs["scheduler"].kill()
            killed_at = time.monotonic()
            rest = [line for line in lines if line]
        elapsed = time.monotonic() - killed_at
        assert elapsed < 8  # silent 2.5 s, then 2 s of waiting for a scheduler: not the idle timeout
        errors = [json.loads(line[len("data: "):])["error"] for line in rest if line.startswith('data: {"error"')]
        assert [e["code"] for e in errors] == [503]
        assert rest[-1] == "data: [DONE]"
        refused = httpx.post(d.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=30)
        assert refused.status_code == 503
        # A new scheduler takes over; workers and gateway stay as they are.
        d.start("scheduler", ["scheduler", "--nats-url", d.nats.url, "--model", d.model, "--served-model-name", "tiny"])
        d.wait_healthy()
        ok = httpx.post(d.base_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        d.close()


def test_a_lone_nats_restart_under_load_loses_no_request(tiny_llama):
    """Every service reconnects; the gateway and the scheduler resume what was in flight
    (outputs and submits the gap swallowed), so each request completes as without it."""
    d = Deployment(str(tiny_llama), worker_args=["--max-model-len", "512", "--num-kv-blocks", "256"])
    try:
        d.wait_healthy()
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        expected = httpx.post(d.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        def one(_):
            start = time.monotonic()
            try:
                r = httpx.post(d.base_url + "/v1/completions", json=body, timeout=60)
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                return r.status_code, text, time.monotonic() - start
            except httpx.HTTPError as exc:
                return type(exc).__name__, "", time.monotonic() - start

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(8)]
            time.sleep(0.3)
            d.nats.restart()
            results = [f.result(timeout=90) for f in futures]
        assert [(code, text) for code, text, _ in results] == [(200, expected)] * 8, results
        assert all(took < 45 for _, _, took in results), results
        restarted = time.monotonic()
        d.wait_healthy(timeout_s=30)
        ok = httpx.post(d.base_url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200
        assert time.monotonic() - restarted < 30
    finally:
        d.close()


def test_a_service_that_cannot_reach_nats_says_so_and_stops_at_once_on_ctrl_c(tiny_llama, tmp_path):
    """A wrong --nats-url: each service retries (NATS may come up after it) but says so
    after a few seconds rather than hang in silence, and Ctrl-C stops it then, with the
    status of a process SIGINT ended and no traceback (the gateway, whose start-up uvicorn
    waits for whatever the signal, once took its 30 s shutdown limit and exited 1)."""
    import subprocess
    import sys

    from llmbus.deploy.serve import free_port

    url = f"nats://127.0.0.1:{free_port()}"  # (nothing listens there)
    procs, logs = {}, {}
    for service in ("scheduler", "tokenizer", "worker", "gateway"):
        logs[service] = tmp_path / f"{service}.log"
        port = ["--port", str(free_port())] if service == "gateway" else []
        with logs[service].open("w") as err:
            procs[service] = subprocess.Popen([sys.executable, "-m", "llmbus", service, "--nats-url", url,
                                               "--model", str(tiny_llama), *port], stderr=err)
    try:
        deadline = time.monotonic() + 60
        for service, proc in procs.items():
            while f"cannot reach NATS at {url}" not in logs[service].read_text():
                assert proc.poll() is None and time.monotonic() < deadline, f"{service} said nothing"
                time.sleep(0.1)
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
        codes = {service: proc.wait(timeout=15) for service, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    assert codes == dict.fromkeys(procs, 130)
    assert not [s for s in procs if "Traceback" in logs[s].read_text()]
