"""How the services behave when a part stops answering: errors that come quickly, never hangs."""

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
                   scheduler_args=["--step-timeout", "2"])
    try:
        d.wait_healthy()
        yield d
    finally:
        for proc in d.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        d.close()


def test_a_worker_that_stops_answering_fails_the_request_instead_of_hanging(deployment):
    worker = deployment.procs["worker"]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        resp = httpx.post(deployment.base_url + "/v1/completions",
                          json={"model": "tiny", "prompt": "hello", "max_tokens": 8}, timeout=30)
        elapsed = time.monotonic() - start
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert resp.status_code == 500
    assert "did not answer" in resp.json()["error"]["message"]
    assert elapsed < 15
    # Once the worker is back, the same deployment serves again and has leaked nothing.
    ok = httpx.post(deployment.base_url + "/v1/completions",
                    json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": True}, timeout=30)
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 8
    assert deployment.stats()["kv_cache_usage"] == 0


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
