"""The gateway's app alone: a core's µs per streamed token with no network and no NATS.
`--streams` streaming completions go through the app's ASGI interface in this process,
against an engine that hands each stream one token a step; the CPU time of the whole run
over the tokens streamed, best of `--runs`.

    python scripts/gateway_stream_costs.py --model /tmp/tinyllama [--streams 128] [--tokens 128] [--runs 4]

Run on uvloop where it is installed, as uvicorn runs the gateway. What `llmbus bench
control-plane` measures end to end adds uvicorn, the sockets and the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Engine:
    """What the app asks of the engine client, answering each step at once."""

    reply_subject = "bench"
    max_model_len = 4096
    max_lora_rank = 16

    def __init__(self, tokenizer, streams: int, tokens: int) -> None:
        self.tokenizer, self.streams, self.tokens = tokenizer, streams, tokens
        self.queues, self.pending = {}, []

    async def tokenize(self, request, headers=None, attempts=3, timeout_s=None):
        from services.tokenizer.shell.service import tokenize

        return tokenize(self.tokenizer, request).token_ids

    async def scheduler_info(self, max_age_s=2.0):
        from shared.messages import SchedulerInfo, SchedulerStats

        return SchedulerInfo("s1", "bench", 1, self.max_model_len, SchedulerStats(), max_lora_rank=16)

    def scheduler_silent(self) -> bool:
        return False

    def open(self, ids, queue) -> None:
        self.queues.update(dict.fromkeys(ids, queue))

    def close(self, ids) -> None:
        for i in ids:
            self.queues.pop(i, None)

    def abort_soon(self, ids) -> None:
        pass

    async def submit(self, request) -> None:
        self.pending.append(request.request_id)

    async def run(self) -> None:
        from shared.messages import EngineCoreOutput, FinishReason

        ids = self.tokenizer.encode(" hello world and more words", add_special_tokens=False)
        while len(self.pending) < self.streams:
            await asyncio.sleep(0.001)
        for step in range(self.tokens):
            last = step == self.tokens - 1
            for rid in self.pending:
                self.queues[rid].put_nowait(EngineCoreOutput(rid, [ids[step % len(ids)]],
                                                             FinishReason.LENGTH if last else None))
            await asyncio.sleep(0)  # (twice: every stream's task writes its chunk before the next step)
            await asyncio.sleep(0)


async def one(app, body: bytes) -> int:
    done, sent, chunks = asyncio.Event(), [False], [0]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            chunks[0] += 1

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"bench")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    done.set()
    return chunks[0]


async def main(args) -> None:
    from services.gateway.app import create_app
    from shared.gc_heap import freeze_heap
    from services.tokenizer.tokenizer import Tokenizer
    from shared.config import GatewayConfig

    tokenizer = Tokenizer(Path(args.model))
    engine = Engine(tokenizer, args.streams, args.tokens)

    async def factory(on_stats):
        return engine

    app = create_app(factory, tokenizer, GatewayConfig("bench"))
    into, out = asyncio.Queue(), asyncio.Queue()
    life = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, into.get, out.put))
    await into.put({"type": "lifespan.startup"})
    await out.get()
    body = json.dumps({"model": "bench", "prompt": "hi", "max_tokens": args.tokens, "stream": True}).encode()
    freeze_heap("gateway_stream_costs")  # (as the gateway's process does once ready)
    runs = []
    for _ in range(args.runs):
        engine.pending = []
        start = time.process_time()
        await asyncio.gather(engine.run(), *(one(app, body) for _ in range(args.streams)))
        runs.append((time.process_time() - start) / (args.streams * args.tokens) * 1e6)
    print(json.dumps({"streams": args.streams, "tokens": args.tokens, "us_per_token": [round(r, 1) for r in runs],
                      "best": round(min(runs), 1)}))
    await into.put({"type": "lifespan.shutdown"})
    await life


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model folder (its tokenizer is all that is read)")
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=4)
    try:  # (the loop uvicorn runs the gateway on)
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    asyncio.run(main(parser.parse_args()))
