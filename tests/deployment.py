"""Real deployments for end-to-end tests: `llmbus serve` as a user types it, or
nats-server + service processes started one by one, as compose runs them."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import nats

from llmbus.deploy.serve import NatsServer, free_port, spawn_service, start_serve, stop_all


class Deployment:
    def __init__(self, model: str, name: str = "tiny", worker_args=(), scheduler_args=(), gateway_args=(), env=None,
                 num_workers: int = 1):
        self.model = model
        self.name = name
        self.nats = NatsServer().start()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ, **(env or {}))
        self.procs: dict[str, subprocess.Popen] = {}
        common = ["--nats-url", self.nats.url, "--model", model, "--served-model-name", name]
        self.start("scheduler", ["scheduler", *common, *scheduler_args])
        self.start("tokenizer", ["tokenizer", *common])
        self.worker_argv = ["worker", *common, *worker_args]
        self.num_workers = num_workers
        for i in range(num_workers):
            self.start("worker" if i == 0 else f"worker{i + 1}", self.worker_argv)
        self.start("gateway", ["gateway", *common, "--port", str(self.port), *gateway_args])

    def start(self, key: str, argv: list[str]) -> subprocess.Popen:
        self.procs[key] = spawn_service(argv, env=self.env)
        return self.procs[key]

    def start_gateway(self, key: str, *extra: str) -> str:
        port = free_port()
        self.start(key, ["gateway", "--nats-url", self.nats.url, "--model", self.model,
                         "--served-model-name", self.name, "--port", str(port), *extra])
        return f"http://127.0.0.1:{port}"

    def wait_healthy(self, base_url: str | None = None, timeout_s: float = 120.0) -> dict:
        """Until /health is green with every worker it started joined (requests sent while
        only the first had joined would all stay on it), as `llmbus serve` waits."""
        url = (base_url or self.base_url) + "/health"
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            for key, proc in self.procs.items():
                assert proc.poll() is None, f"{key} exited with {proc.returncode}"
            try:
                last = httpx.get(url, timeout=2)
                if last.status_code == 200 and last.json()["workers"] >= self.num_workers:
                    return last.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not healthy in {timeout_s} s: {last and last.text}")

    def stats(self) -> dict:
        return httpx.get(self.base_url + "/health", timeout=5).json()["stats"]

    def close(self) -> None:
        stop_all(list(self.procs.values()))
        self.nats.stop()


def llmbus_serve(args: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`llmbus serve ARGS` on a free port, and its base URL once it says it is serving
    (llmbus.deploy.serve.start_serve); the process has its log open as `proc.log`."""
    proc, url = start_serve(args, log, env)
    proc.log = log
    return proc, url


async def login(url: str, user: str | None = None, password: str | None = None, **options):
    """A connection that reports its errors instead of retrying: (client or None, errors)."""
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    try:
        nc = await nats.connect(url, user=user, password=password, allow_reconnect=False, connect_timeout=3,
                                error_cb=on_error, **options)
    except Exception as exc:  # noqa: BLE001 - nats-py raises its own kinds
        errors.append(str(exc))
        return None, errors
    return nc, errors


def completion_texts(base_url: str, prompts: list[str], **request) -> list[str]:
    """Each prompt's completion text, asked all at once with the openai client (what a fault
    test compares its faulted run with: that run asks them together too, and greedy output
    does not depend on the batch)."""
    import concurrent.futures

    import openai

    with openai.OpenAI(base_url=base_url + "/v1", api_key="none", timeout=120) as client, \
            concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: client.completions.create(prompt=p, **request).choices[0].text, prompts))


async def stream_texts(base_url: str, prompts: list[str], max_tokens: int, on_started=None,
                       started_before_call: int | None = None) -> list[str]:
    """Each prompt's greedy completion, streamed at once with the openai client; `on_started()`
    once `started_before_call` streams (default: all) have their first token."""
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    started, threshold = 0, started_before_call or len(prompts)

    async def one(prompt: str) -> str:
        nonlocal started
        text, first = "", True
        stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True,
                                                 max_tokens=max_tokens, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            if first:
                first, started = False, started + 1
                if started == threshold and on_started is not None:
                    on_started()
        return text

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()

