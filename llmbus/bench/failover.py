"""`llmbus bench failover`: what a replica's death costs the clients streaming through it.

Starts `llmbus serve --workers 2 --tokenizers 2 --nats-cluster 3` (the command users run,
with its own three nats-servers), and for each kind of replica asked for (worker,
tokenizer, scheduler, the NATS node the scheduler is connected to): N greedy streams
without a fault, then the same N streams with one replica of that kind SIGKILLed (a
tokenizer as the requests arrive, the others once every stream has tokens). Reports the
longest pause any client saw in the faulty run (the longest gap between two
of its events, the first token counted from its request), how many streams failed, and
how many came back with a text other than the fault-free one (both must be 0), then
waits for the supervisor to bring the replica back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from llmbus.bench.streaming_client import sse_data
from llmbus.model_fetch import resolve_model
from llmbus.deploy.nats_server import node_with_client
from llmbus.deploy.serve import free_port, live_children
from llmbus.deploy.supervisor import stop_all

KINDS = ("worker", "tokenizer", "scheduler", "nats")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--kill", action="append", choices=KINDS, help="kinds to kill, in turn (default: all)")


async def _stream_all(url: str, n: int, max_tokens: int, on_event, on_start=None) -> list[tuple[str | None, float]]:
    """Each stream's text (None if it failed) and its longest pause."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i: int) -> tuple[str | None, float]:
            body = {"model": "bench", "prompt": f"story {i}:", "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            text, last, longest = "", time.monotonic(), 0.0
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        return None, longest
                    async for data in sse_data(resp):
                        if not data.startswith("{"):
                            continue
                        event = json.loads(data)
                        if "error" in event:
                            return None, longest
                        now = time.monotonic()
                        longest, last = max(longest, now - last), now
                        text += event["choices"][0]["text"]
                        on_event(i)
            except httpx.HTTPError:
                return None, longest
            return text, longest

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        if on_start is not None:
            on_start()
        return await asyncio.gather(*tasks)


def _replicas(serve: subprocess.Popen, kind: str) -> list:
    return live_children(serve.pid, kind)


def _wait(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"failover: {what}")
        time.sleep(0.2)


def _healthy(url: str, workers: int) -> bool:
    try:
        resp = httpx.get(url + "/health", timeout=2)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and resp.json()["workers"] == workers


def _kill_run(url: str, serve: subprocess.Popen, kind: str, args) -> dict:
    expected = asyncio.run(_stream_all(url, args.streams, args.max_tokens, lambda i: None))
    # The NATS node that bites: the scheduler's (its steps and every output go through it).
    victim = node_with_client(serve.pid, "scheduler") if kind == "nats" else _replicas(serve, kind)[0]
    seen: set[int] = set()
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        victim.send_signal(signal.SIGKILL)

    def on_event(i: int) -> None:
        seen.add(i)
        if kind != "tokenizer" and not killed_at and len(seen) == args.streams:
            kill()

    results = asyncio.run(_stream_all(url, args.streams, args.max_tokens, on_event,
                                      on_start=kill if kind == "tokenizer" else None))
    count = {"scheduler": 1, "nats": 3}.get(kind, 2)
    _wait(lambda: victim not in _replicas(serve, kind) and len(_replicas(serve, kind)) == count and _healthy(url, 2),
          180, f"the {kind} did not come back")
    return {
        "kill": kind,
        "streams": args.streams,
        "longest_pause_s": round(max(pause for _, pause in results), 3),
        "failed": sum(text is None for text, _ in results),
        "altered": sum(text is not None and text != want for (text, _), (want, _) in zip(results, expected)),
        # From the kill to the replica up again and /health green (2 workers): at least the
        # streams' run, which it waits out.
        "replica_back_after_s": round(time.monotonic() - killed_at[0], 1),
    }


def run(args: argparse.Namespace) -> int:
    model = str(resolve_model(args.model))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "llmbus", "serve", "--model", model, "--served-model-name", "bench",
         "--port", str(port), "--workers", "2", "--tokenizers", "2", "--nats-cluster", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ),
    )
    try:
        _wait(lambda: _healthy(url, 2), 300, "the deployment did not become healthy")
        rows = [_kill_run(url, serve, kind, args) for kind in (args.kill or KINDS)]
        print(f"streams {args.streams} x {args.max_tokens} tokens, "
              "`llmbus serve --workers 2 --tokenizers 2 --nats-cluster 3`:")
        for row in rows:
            print(f"  SIGKILL {row['kill']:<9}: longest pause {row['longest_pause_s']:.2f} s, "
                  f"failed {row['failed']}, altered {row['altered']}, back within {row['replica_back_after_s']} s")
        print(json.dumps(rows))
        return 0 if all(r["failed"] == 0 and r["altered"] == 0 for r in rows) else 1
    finally:
        stop_all([serve], 60)
