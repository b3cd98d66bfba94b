"""`llmbus serve --workers 2 --tokenizers 2 --nats-cluster 3 --nats-tls` itself under
faults, as a user runs it — a closed bus: every service logged in as its own identity with
its role's subjects, over TLS, routes included (tests/test_bus_security.py): replicas SIGKILLed one kind at a time under 24 concurrent streams (the real
openai client) — a worker, a tokenizer, the scheduler, the NATS node the scheduler is
connected to — every stream finishing with the text of a fault-free run and the killed
replica back; metrics that come back to 0 after 100 streams are dropped; a killed
gateway's requests dropped by the scheduler, a stopped one's resumed; and a SIGTERM that
stops everything cleanly."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import random
import re
import signal
import ssl
import stat
import subprocess
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import psutil
import pytest

from llmbus.deploy.nats_server import node_with_client
from deployment import completion_texts, llmbus_serve, login
from llmbus.deploy.serve import live_children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_STREAMS = 24
MAX_TOKENS = 48
GATEWAY_TIMEOUT_S = 3.0  # the scheduler's --gateway-timeout here (10 s by default)
LONG_REQUEST = {"max_tokens": 900, "extra_body": {"ignore_eos": True}}  # ~12 s for 32 of them on 2 cores


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    proc, url = llmbus_serve(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--workers", "2", "--tokenizers", "2",
         "--nats-cluster", "3", "--nats-tls", "--nats-monitor", "--num-kv-blocks", "256", "--max-model-len", "1024"],
        tmp_path_factory.mktemp("serve") / "stderr.log",
        env={"LLMBUS_GATEWAY_TIMEOUT": str(GATEWAY_TIMEOUT_S)},
    )
    yield proc, url
    if proc.poll() is None:
        proc.kill()


def replicas(proc: subprocess.Popen, kind: str) -> list[psutil.Process]:
    return live_children(proc.pid, kind)


def prompts() -> list[str]:
    return [f"story {i}: once upon a time" for i in range(NUM_STREAMS)]


# Output that is long whatever the random model picks: 24 colours, each one to three tokens.
COLOURS = {"type": "object", "properties": {"colours": {
    "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 24, "maxItems": 24}},
    "required": ["colours"], "additionalProperties": False}
JSON_REQUEST = {"max_tokens": 200, "extra_body": {"structured_outputs": {"json": COLOURS}}}
PLAIN_REQUEST = {"max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


async def stream_all(base_url: str, on_first_chunks, request: dict = PLAIN_REQUEST) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    started = 0

    async def one(prompt: str) -> str:
        nonlocal started
        text, first = "", True
        stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True, **request)
        async for chunk in stream:
            text += chunk.choices[0].text
            if first:
                first, started = False, started + 1
                if started == NUM_STREAMS:
                    on_first_chunks()
        return text

    try:
        return await asyncio.gather(*(one(p) for p in prompts()))
    finally:
        await client.close()


def expected_texts(base_url: str, request: dict = PLAIN_REQUEST, prompts_: list[str] | None = None) -> list[str]:
    """Each prompt's greedy text with no fault."""
    return completion_texts(base_url, prompts_ or prompts(), model="tiny", temperature=0, **request)


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def nats_run_dir(proc: subprocess.Popen) -> Path:
    """The deployment's own folder of secrets (its TLS files), 0700: where a node's CA is."""
    node = next(c for c in psutil.Process(proc.pid).children() if "nats-server" in c.name())
    config = Path(node.cmdline()[node.cmdline().index("-c") + 1]).read_text()
    return Path(re.search(r'ca_file: "([^"]+)"', config).group(1)).parents[1]


def test_its_bus_speaks_only_tls_and_takes_no_anonymous_client(served):
    """--nats-tls --nats-cluster 3: clients and routes speak only TLS; a client that does
    not trust the deployment's CA cannot even reach the login, one that does has no
    credentials. (Before the faults below: the deployment as it started.)"""
    proc, _ = served
    urls = re.search(r"\(NATS (\S+)\)", proc.banner).group(1).split(",")
    assert len(urls) == 3 and all(u.startswith("tls://127.0.0.1:") for u in urls)
    configs = [Path(c.cmdline()[c.cmdline().index("-c") + 1]).read_text()
               for c in psutil.Process(proc.pid).children() if "nats-server" in c.name()]
    assert len(configs) == 3 and all(c.count("tls {") == 2 for c in configs)  # clients and routes
    ca = re.search(r'ca_file: "([^"]+)"', configs[0]).group(1)
    assert stat.S_IMODE(nats_run_dir(proc).stat().st_mode) == 0o700

    async def attempts():
        untrusting, errors = await login(urls[0])  # the system's CAs only
        assert untrusting is None and any("certificate verify failed" in e for e in errors), errors
        trusting = ssl.create_default_context(cafile=ca)
        anonymous, errors = await login(urls[0], tls=trusting)  # TLS fine, but no credentials
        assert anonymous is None and any("authorization violation" in e.lower() for e in errors), errors

    asyncio.run(attempts())


@pytest.mark.parametrize("kind", ["worker", "tokenizer", "scheduler", "nats"])
def test_a_killed_replica_loses_no_stream_and_comes_back(served, kind):
    proc, url = served
    expected = expected_texts(url)
    before = replicas(proc, kind)
    # The NATS node that bites: the scheduler's (its steps, and every output, go through it).
    victim = node_with_client(proc.pid, "scheduler") if kind == "nats" else before[0]
    # A tokenizer serves only the start of a request: it dies as the streams are sent;
    # the others die once every stream is under way.
    if kind == "tokenizer":
        texts = asyncio.run(_kill_then_stream(url, victim))
    else:
        texts = asyncio.run(stream_all(url, lambda: victim.kill()))
    assert texts == expected
    wait_until(lambda: len(replicas(proc, kind)) == len(before) and victim not in replicas(proc, kind), 60,
               f"the supervisor did not restart the {kind}")
    wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200
               and httpx.get(url + "/health", timeout=5).json()["workers"] == 2, 120, "not 2 workers again")
    assert proc.poll() is None
    assert expected_texts(url) == expected  # and it serves the same afterwards


def test_a_worker_killed_mid_json_leaves_every_json_valid_and_as_without_the_fault(served):
    """Each migrated request's matcher is rebuilt on the other worker from its tokens."""
    proc, url = served
    expected = expected_texts(url, JSON_REQUEST)
    for text in expected:
        jsonschema.validate(json.loads(text), COLOURS)
    victim = replicas(proc, "worker")[0]
    texts = asyncio.run(stream_all(url, lambda: victim.kill(), JSON_REQUEST))
    assert texts == expected
    wait_until(lambda: httpx.get(url + "/health", timeout=5).json()["workers"] == 2, 120, "not 2 workers again")


async def _kill_then_stream(url: str, victim: psutil.Process) -> list[str]:
    async def kill_soon():
        await asyncio.sleep(0.05)
        victim.kill()

    killer = asyncio.ensure_future(kill_soon())
    texts = await stream_all(url, lambda: None)
    await killer
    return texts


def metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} missing"
    return sum(values)


def test_metrics_come_back_to_zero_after_100_dropped_streams(served):
    _, url = served
    rng = random.Random(0)

    async def drop(i: int) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "prompt": f"drop {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                keep = rng.randint(0, 12)
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        keep -= 1
                        if keep < 0:
                            return  # the client goes away mid-stream

    async def main():
        await asyncio.gather(*(drop(i) for i in range(100)))

    asyncio.run(main())
    dropped_at = time.monotonic()

    def idle() -> bool:
        text = httpx.get(url + "/metrics", timeout=5).text
        return (metric(text, "llmbus:num_requests_running") == 0 and metric(text, "llmbus:num_requests_waiting") == 0
                and metric(text, "llmbus:kv_cache_usage_perc") == 0)

    wait_until(idle, 5, "metrics did not come back to 0")
    assert time.monotonic() - dropped_at < 2.0
    stats = httpx.get(url + "/health", timeout=5).json()["stats"]
    assert (stats["num_running_reqs"], stats["num_waiting_reqs"], stats["kv_cache_usage"]) == (0, 0, 0)
    text = httpx.get(url + "/metrics", timeout=5).text
    assert metric(text, "llmbus:generation_tokens_total") > 0  # counted as sent, though none finished


def test_a_scheduler_the_host_does_not_run_for_a_while_keeps_its_workers(served):
    """A loaded host that leaves the scheduler unscheduled for longer than the workers'
    heartbeat timeout (2 s): their heartbeats wait unread in its socket, so they are not
    dead (it once removed them, and every running request recomputed)."""
    proc, url = served
    expected = expected_texts(url)
    scheduler = replicas(proc, "scheduler")[0]
    logged = len(proc.log.read_text())

    def descheduled():
        scheduler.suspend()
        time.sleep(2.3)  # past the heartbeat timeout, within the gateways' 2.5 s for a scheduler
        scheduler.resume()

    assert asyncio.run(stream_all(url, descheduled)) == expected
    log = proc.log.read_text()[logged:]
    assert "removed" not in log, log[-2000:]
    assert httpx.get(url + "/health", timeout=5).json()["workers"] == 2


def test_a_gateway_the_host_does_not_run_for_a_while_answers_what_came_meanwhile(served):
    """Requests that arrive while the host does not run the gateway, for longer than it
    waits on a scheduler's heartbeat (2.5 s), are served when it runs again, not 503'd:
    the heartbeats it missed wait unread beside them, and are read before the requests
    (the scheduler, whose monitor judged silence by the clock alone, did not do as well)."""
    proc, url = served
    expected = expected_texts(url)[:4]
    gateway = replicas(proc, "gateway")[0]

    def one(prompt: str):
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            return client.completions.create(model="tiny", prompt=prompt, temperature=0, **PLAIN_REQUEST).choices[0].text

    gateway.suspend()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            pending = [pool.submit(one, prompt) for prompt in prompts()[:4]]
            time.sleep(3.0)
            gateway.resume()
            assert [future.result(timeout=60) for future in pending] == expected
    finally:
        gateway.resume()


def scheduler_stats(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()["stats"]


def test_a_killed_gateway_s_requests_are_dropped_not_run_to_their_end(served):
    """Its clients went with it: the scheduler stops generating for them once it has not
    heard the gateway for --gateway-timeout, instead of running all 32 to their 900th
    token while the restarted gateway's requests wait behind them."""
    proc, url = served
    generated_before = scheduler_stats(url)["num_generation_tokens"]
    gateway = replicas(proc, "gateway")[0]
    logged = len(proc.log.read_text())

    async def stream_then_kill() -> None:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        async def one(prompt: str) -> None:
            with contextlib.suppress(openai.APIError):
                stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True,
                                                         **LONG_REQUEST)
                async for _ in stream:
                    pass

        streams = [asyncio.ensure_future(one(f"long {i}: once upon a time")) for i in range(32)]
        async with httpx.AsyncClient(timeout=5) as http:
            while True:  # until the scheduler holds all 32
                stats = (await http.get(url + "/health")).json()["stats"]
                if stats["num_running_reqs"] + stats["num_waiting_reqs"] == 32:
                    break
                await asyncio.sleep(0.05)
        gateway.kill()
        await asyncio.gather(*streams)
        await client.close()

    asyncio.run(stream_then_kill())

    def answers() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:  # (not listening yet)
            return False

    wait_until(answers, 60, "the gateway did not come back")
    wait_until(lambda: scheduler_stats(url)["num_running_reqs"] + scheduler_stats(url)["num_waiting_reqs"] == 0,
               60, "the dead gateway's requests still run")
    generated = scheduler_stats(url)["num_generation_tokens"] - generated_before
    assert 0 < generated < 32 * 900
    assert re.search(r"silent for 3 s: dropping its [1-9]\d* request", proc.log.read_text()[logged:])


def test_a_gateway_the_host_stops_past_the_timeout_gets_its_streams_back(served):
    """Its requests are dropped while it is silent, and it is told to send them again when
    it speaks: every stream ends with the text of a run without the stop."""
    proc, url = served
    prompts_ = [f"stopped {i}: once upon a time" for i in range(16)]  # two rounds of 8 (the KV cache's)
    expected = expected_texts(url, LONG_REQUEST, prompts_)
    gateway = replicas(proc, "gateway")[0]
    logged = len(proc.log.read_text())

    async def stream_all_with_a_stop() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        stopped = []

        async def one(prompt: str) -> str:
            text = ""
            stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True,
                                                     **LONG_REQUEST)
            async for chunk in stream:
                text += chunk.choices[0].text
                if not stopped:
                    stopped.append(True)
                    gateway.suspend()
                    await asyncio.sleep(GATEWAY_TIMEOUT_S + 2)  # (the streams' reads wait too)
                    gateway.resume()
            return text

        try:
            return await asyncio.gather(*(one(p) for p in prompts_))
        finally:
            gateway.resume()
            await client.close()

    assert asyncio.run(stream_all_with_a_stop()) == expected
    log = proc.log.read_text()[logged:]
    assert "request(s)" in log and "speaks again: it resumes its requests" in log, log[-2000:]


def test_a_sigkill_of_llmbus_serve_leaves_no_process_behind(tiny_llama, tmp_path):
    """Its children are told to stop when it dies (PR_SET_PDEATHSIG), the NATS nodes
    with the services: a service draining into a cluster that is going away waited on
    nats-py's reconnection, and some were seen running 15 minutes later. Each stops within
    its drain's and close's bounds and the few seconds it gives the rest (shared/bus.py),
    well before the last resort (30 s)."""
    proc, _ = llmbus_serve(["--model", str(tiny_llama), "--served-model-name", "tiny", "--workers", "2",
                            "--nats-cluster", "3", "--nats-tls", "--num-kv-blocks", "64"], tmp_path / "stderr.log")
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 8  # 3 nodes, the scheduler, a tokenizer, 2 workers, the gateway
    proc.kill()
    proc.wait()

    def left() -> list[str]:
        running = []
        for child in children:
            with contextlib.suppress(psutil.Error):  # (gone meanwhile)
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    running.append(" ".join(child.cmdline()[2:4]) or child.name())
        return running

    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []


def test_sigterm_stops_everything_in_order_without_tracebacks(served):
    proc, _ = served
    children = psutil.Process(proc.pid).children(recursive=True)
    run_dir = nats_run_dir(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    stderr = proc.log.read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    # Through every fault, no service was refused a subject it needs (it would log it).
    assert "permissions violation" not in stderr and "could not log in" not in stderr, stderr[-3000:]
    wait_until(lambda: not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], 10,
               "children left behind")
    assert not run_dir.exists()  # the deployment's secrets go with it
