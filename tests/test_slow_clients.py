"""A client that reads slower than tokens come gets them merged, one chunk for all that
waited, in order and nothing lost; a client that keeps up gets a chunk a token. The gateway's
own app is driven at the ASGI level so that the client's pace is the pace of `send` (a
network's back-pressure, without a network's buffers in the way)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.app import create_app
from services.tokenizer.tokenizer import Tokenizer
from shared.config import GatewayConfig
from shared.messages import EngineCoreOutput, FinishReason
from test_gateway import SCRIPT, FakeEngine

TOKEN_EVERY_S = 0.002


class PacedEngine(FakeEngine):
    """SCRIPT's tokens, one every TOKEN_EVERY_S, as a decoding engine sends them."""

    async def submit(self, request) -> None:
        self.submitted.append(request)
        queue = self.queues[request.request_id]
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)

        async def emit():
            for i, token_id in enumerate(ids):
                await asyncio.sleep(TOKEN_EVERY_S)
                last = i == len(ids) - 1
                queue.put_nowait(EngineCoreOutput(request.request_id, [token_id], FinishReason.LENGTH if last else None))

        self.emitter = asyncio.create_task(emit())


async def stream(app, body: dict, send_takes_s: float) -> list[dict]:
    """The events of one streamed request whose client takes `send_takes_s` to take each write."""
    startup, events = asyncio.Queue(), asyncio.Queue()
    lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, startup.get, events.put))
    await startup.put({"type": "lifespan.startup"})
    assert (await events.get())["type"] == "lifespan.startup.complete"
    done, sent = asyncio.Event(), [False]
    raw = json.dumps(body).encode()

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()  # (the client stays until the answer is read)
        return {"type": "http.disconnect"}

    chunks: list[bytes] = []
    status = []

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body" and message.get("body"):
            await asyncio.sleep(send_takes_s)
            chunks.append(message["body"])

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    done.set()
    await startup.put({"type": "lifespan.shutdown"})
    await lifespan
    if status != [200]:  # (an answer before the stream began: one JSON body)
        return [{"status": status[0], **json.loads(b"".join(chunks))}]
    lines = [line for line in b"".join(chunks).decode().split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer(tiny_llama)


def test_a_slow_client_gets_the_waiting_tokens_as_one_chunk_and_a_fast_one_a_chunk_a_token(tokenizer):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True,
               "stream_options": {"include_usage": True}}
    num_tokens = len(tokenizer.encode(SCRIPT, add_special_tokens=False))

    def run(send_takes_s: float) -> list[dict]:
        engine = PacedEngine(tokenizer)

        async def factory(on_stats):
            return engine

        return asyncio.run(stream(create_app(factory, tokenizer, GatewayConfig("tiny")), request, send_takes_s))

    fast, slow = run(0.0), run(TOKEN_EVERY_S * 8)
    for events in (fast, slow):
        texts = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
        assert "".join(texts) == SCRIPT  # in order, nothing lost
        assert all(len(e["choices"]) <= 1 for e in events)  # one entry a choice a chunk
        assert events[-1]["usage"]["completion_tokens"] == num_tokens
    content = [[e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")] for events in (fast, slow)]
    # (a token that ends inside a character sends nothing until the character is whole)
    assert len(content[0]) >= num_tokens - SCRIPT.encode().count(b"\xc3") - 2
    assert len(content[1]) < len(content[0]) / 2


class SilentEngine(FakeEngine):
    """Takes every request and never answers."""

    async def submit(self, request) -> None:
        self.submitted.append(request)


def test_an_engine_silent_past_the_idle_timeout_fails_the_stream_but_a_slow_client_never_does(tokenizer):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True}

    def run(engine_class, send_takes_s: float) -> list[dict]:
        engine = engine_class(tokenizer)

        async def factory(on_stats):
            return engine

        config = GatewayConfig("tiny", idle_timeout_s=0.3)
        return asyncio.run(stream(create_app(factory, tokenizer, config), request, send_takes_s))

    silent = run(SilentEngine, 0.0)
    assert silent[0]["status"] == 503 and "produced nothing for 0 s" in silent[0]["error"]["message"]
    # 28 tokens come in 56 ms; the client takes 0.15 s a write, 4 s in all: far past the
    # idle timeout, with outputs waiting for it all along
    slow = run(PacedEngine, 0.15)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in slow if e["choices"]) == SCRIPT
