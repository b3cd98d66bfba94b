"""`llmbus serve` starts a whole deployment, serves, and leaves no process behind on SIGTERM."""

import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from llmbus.serve import free_port

pytestmark = pytest.mark.timeout(300)


def test_serve_starts_everything_and_stops_everything(tiny_llama):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmbus", "serve", "--model", str(tiny_llama), "--served-model-name", "tiny",
         "--port", str(port), "--tokenizers", "2", "--num-kv-blocks", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once /health is green
        assert f"http://127.0.0.1:{port}/v1" in line, proc.stderr.read() if proc.poll() is not None else line
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "nats-server" in names
        for service in ("scheduler", "worker", "gateway"):
            assert f"llmbus {service}" in names
        assert names.count("llmbus tokenizer") == 2
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                          json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=60)
        assert resp.status_code == 200
        assert resp.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        time.sleep(0.1)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
