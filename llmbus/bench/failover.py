"""`llmbus bench failover`: how long a worker's death interrupts its streams.

Starts a deployment with two workers (its own nats-server), streams N greedy requests,
SIGKILLs one worker once every stream has tokens, and reports, for the streams that
stalled, the time from the kill to their next token (produced by the other worker after
the scheduler noticed and recomputed them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import time
import urllib.request

import httpx

from llmbus.model_fetch import resolve_model
from llmbus.serve import NatsServer, free_port, spawn_service, stop_all, wait_healthy


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)


async def _stream_all(url: str, n: int, max_tokens: int, on_token) -> None:
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(i: int) -> None:
            body = {"model": "bench", "prompt": f"story {i}:", "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        on_token(i, time.monotonic())

        await asyncio.gather(*(one(i) for i in range(n)))


def run(args: argparse.Namespace) -> int:
    model = str(resolve_model(args.model))
    nats = NatsServer().start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    common = ["--nats-url", nats.url, "--model", model, "--served-model-name", "bench"]
    procs = [spawn_service(["scheduler", *common]), spawn_service(["tokenizer", *common])]
    workers = [spawn_service(["worker", *common]) for _ in range(2)]
    procs += workers + [spawn_service(["gateway", *common, "--port", str(port)])]
    try:
        wait_healthy(url, procs, 300)
        while json.load(urllib.request.urlopen(url + "/health"))["workers"] < 2:
            time.sleep(0.2)
        last: dict[int, float] = {}
        gaps: dict[int, float] = {}
        killed = {}

        def on_token(i: int, now: float) -> None:
            if "at" in killed and i not in gaps and last.get(i, 0) < killed["at"] <= now:
                gaps[i] = now - killed["at"]
            last[i] = now
            if "at" not in killed and len(last) == args.streams:
                killed["at"] = time.monotonic()
                workers[0].send_signal(signal.SIGKILL)

        asyncio.run(_stream_all(url, args.streams, args.max_tokens, on_token))
        # Streams on the surviving worker also show a gap (one step); the migrated ones
        # are the long gaps.
        values = sorted(gaps.values())
        print(f"streams {args.streams}; after the SIGKILL, time to each stream's next token (s):")
        print(f"  max {values[-1]:.2f}  median {statistics.median(values):.2f}  min {values[0]:.2f}")
        print(json.dumps({"max_s": round(values[-1], 3), "median_s": round(statistics.median(values), 3)}))
        return 0
    finally:
        stop_all(procs)
        nats.stop()
