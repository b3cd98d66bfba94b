"""How the services behave when a part stops answering: errors that come quickly, never hangs."""

import concurrent.futures
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
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, deployment)
        time.sleep(3.0)  # past the 2 s step deadline and heartbeat timeout: declared dead
        health = httpx.get(deployment.base_url + "/health", timeout=10)
        assert health.status_code == 503 and "no worker" in health.json()["reason"]
        assert not pending.done()  # the request waits for a worker rather than failing
        os.kill(worker.pid, signal.SIGCONT)  # it speaks again: rejoins, resets, recomputes
        resp = pending.result(timeout=60)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == expected
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
