"""`llmbus bench control-plane`: the whole control plane — gateways, a tokenizer, N scheduler
shards, NATS — with instant workers (services/worker/instant_runner.py: each step answered
at once, no model), streamed to by many clients at once. Prints output tokens a second and
what each kind of process spent of a core, in all and per output token: how far the
control plane goes before a model is what bounds it.

    llmbus bench control-plane --data-parallel-size 2 --api-server-count 2 --num-requests 512

Each gateway has its own port and the clients take them in turn (as a load balancer in
front of them would); shards get one instant worker each unless --workers says more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmbus.bench.streaming_client import one_request, summarize
from shared.hf.model_folder import read_config, text_config

ROLES = ("gateway", "scheduler", "tokenizer", "worker", "nats")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="whose tokenizer the gateways and tokenizer use (default: "
                        "the default model; its weights are never read)")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="scheduler shards")
    parser.add_argument("--api-server-count", type=int, default=1, help="gateways, each on its own port")
    parser.add_argument("--workers", type=int, default=None, help="instant workers (default: one a shard)")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request streams")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="each shard's")
    parser.add_argument("--step-time-ms", type=float, default=0.0,
                        help="each worker answers a step this long after it arrives (a device's step time: steps "
                             "then fill as a real worker's do, and the scheduler's cost a token is that of full steps)")
    parser.add_argument("--seed", type=int, default=0)


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:  # (each service's log, kept when a request failed)
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def _wait_healthy(url: str, workers: int, procs: list[subprocess.Popen], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("llmbus bench control-plane: a service exited while starting")
        try:
            health = httpx.get(url + "/health", timeout=2)
            if health.status_code == 200 and health.json()["workers"] >= workers:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"llmbus bench control-plane: not healthy with {workers} workers in {timeout_s:.0f} s")


def _cpu_seconds(procs: dict[str, list[subprocess.Popen]]) -> dict[str, tuple[float, float]]:
    """Each role's (user + system, system) seconds of a core so far."""
    import psutil

    seconds = {}
    for role, members in procs.items():
        total = system = 0.0
        for proc in members:
            try:
                times = psutil.Process(proc.pid).cpu_times()
                total += times.user + times.system
                system += times.system
            except psutil.Error:
                pass
        seconds[role] = (total, system)
    return seconds


async def _stream(urls: list[str], model: str, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    # (connections idle for less than uvicorn's 5 s keep-alive: one the server closes just as
    # it is taken again is a ReadError; with several gateways a connection can idle that long)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0)
    semaphore = asyncio.Semaphore(concurrency)
    extra = {"temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:

        async def limited(i: int, prompt: list[int], max_tokens: int):
            async with semaphore:
                url = urls[i % len(urls)] + "/v1/completions"
                return await one_request(client, url, model, prompt, max_tokens, extra)

        warm = await limited(0, requests[0][0][::-1], 4)
        if not warm.ok:
            raise SystemExit(f"llmbus bench control-plane: the first request failed: {warm.error}")
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i, p, n) for i, (p, n) in enumerate(requests)))
        return summarize(results, time.perf_counter() - start)


def run(args) -> int:
    import os

    from llmbus.deploy.nats_server import NatsServer, free_port
    from llmbus.model_fetch import resolve_model

    path = str(resolve_model(args.model))
    vocab = text_config(read_config(path))["vocab_size"]
    shards, gateways = args.data_parallel_size, args.api_server_count
    num_workers = args.workers or shards
    nats = NatsServer().start()
    env = dict(os.environ, LLMBUS_MAX_NUM_SEQS=str(args.max_num_seqs))
    common = ["--nats-url", nats.url, "--model", path, "--served-model-name", "bench"]
    llmbus = [sys.executable, "-m", "llmbus"]
    procs: dict[str, list[subprocess.Popen]] = {role: [] for role in ROLES}
    urls = []
    logs = Path(tempfile.mkdtemp(prefix="llmbus-bench-"))
    try:
        for rank in range(shards):
            procs["scheduler"].append(_start([*llmbus, "scheduler", *common, "--data-parallel-rank", str(rank),
                                              "--data-parallel-size", str(shards)], env, logs / f"scheduler-{rank}.log"))
        procs["tokenizer"].append(_start([*llmbus, "tokenizer", *common], env, logs / "tokenizer.log"))
        for i in range(num_workers):
            procs["worker"].append(_start([sys.executable, "-m", "services.worker.shell.instant_worker",
                                           "--nats-url", nats.url, "--served-model-name", "bench",
                                           "--data-parallel-rank", str(i % shards), "--vocab-size", str(vocab),
                                           "--step-time-ms", str(args.step_time_ms)], env,
                                          logs / f"worker-{i}.log"))
        for i in range(gateways):
            port = free_port()
            procs["gateway"].append(_start([*llmbus, "gateway", *common, "--port", str(port)], env,
                                           logs / f"gateway-{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        procs["nats"] = [nats.proc]
        everyone = [p for members in procs.values() for p in members]
        for url in urls:
            _wait_healthy(url, num_workers, everyone)
        rng = random.Random(args.seed)
        requests = [([rng.randrange(vocab) for _ in range(args.input_len)], args.output_len)
                    for _ in range(args.num_requests)]
        before = _cpu_seconds(procs)
        steps_before = _steps(urls[0])
        summary = asyncio.run(_stream(urls, "bench", requests, args.concurrency))
        spent = {role: (after[0] - before[role][0], after[1] - before[role][1])
                 for role, after in _cpu_seconds(procs).items()}
        steps_after = _steps(urls[0])
    finally:
        for members in procs.values():
            for proc in members:
                if proc is not nats.proc:
                    proc.terminate()
        for members in procs.values():
            for proc in members:
                if proc is not nats.proc:
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
        nats.stop()
    if summary["failed"]:
        print(f"llmbus bench control-plane: {summary['failed']} request(s) failed; the services' logs: {logs}",
              file=sys.stderr)
    else:
        shutil.rmtree(logs, ignore_errors=True)
    tokens = summary["output_tokens"]
    duration = summary["duration_s"]
    report = {
        "data_parallel_size": shards, "api_server_count": gateways, "workers": num_workers,
        "num_requests": args.num_requests, "concurrency": args.concurrency, "step_time_ms": args.step_time_ms,
        "output_tokens": tokens,
        "failed": summary["failed"], "errors": summary["errors"], "duration_s": round(duration, 2),
        "output_tok_s": round(tokens / duration, 1),
        "cores": {role: round(spent[role][0] / duration, 3) for role in ROLES},
        "us_per_output_token": {role: round(spent[role][0] / tokens * 1e6, 2) for role in ROLES if tokens},
        # (the kernel's part of it: socket reads and writes, the event loop's waits)
        "system_us_per_output_token": {role: round(spent[role][1] / tokens * 1e6, 2) for role in ROLES if tokens},
        # (a scheduler's cost a token is mostly its cost a step over the step's tokens: with
        # workers that answer at once, steps are as small as the client keeps them). Prompt
        # and output tokens, as vLLM's iteration_tokens_total counts them.
        "scheduled_tokens_per_step": round((steps_after[1] - steps_before[1]) / max(steps_after[0] - steps_before[0], 1), 1),
        "cpu": _cpu_name(),
    }
    print(json.dumps(report))
    return 0


def _steps(url: str) -> tuple[float, float]:
    """(steps, tokens) every shard has run so far, from the gateway's iteration-tokens
    histogram (vLLM's `iteration_tokens_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [sample for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
               if family.name == "llmbus:iteration_tokens_total" for sample in family.samples]
    return (sum(s.value for s in samples if s.name.endswith("_count")),
            sum(s.value for s in samples if s.name.endswith("_sum")))


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
