"""One streamed completion request as `llmbus bench serve` sends it, timed chunk by chunk
(TTFT, each inter-token latency, end to end), and a run's results summarized as
`vllm bench serve` reports them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import msgspec
import numpy as np

# The client shares the machine with the server it measures: keep its per-chunk work small.
_json_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)


async def sse_data(resp: httpx.Response):
    """A stream's events' data, lines ended at a newline alone as SSE ends them: httpx's
    aiter_lines also ends one at U+2028 and the like, which a server's JSON may hold raw
    (a token's text), and half an event is not JSON."""
    rest = ""
    async for text in resp.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            if line.startswith("data: "):
                yield line[len("data: "):].rstrip("\r")
    if rest.startswith("data: "):
        yield rest[len("data: "):]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt, max_tokens: int,
                      extra: dict | None = None) -> Result:
    result = await _one_request(client, url, model, prompt, max_tokens, extra)
    if result.error.startswith(("RemoteProtocolError", "ConnectError")) and not result.ttft:
        # A kept-alive connection the server closed as it was reused (llama-server does
        # this): the request never started, so sending it again is fair.
        result = await _one_request(client, url, model, prompt, max_tokens, extra)
    return result


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt, max_tokens: int,
                       extra: dict | None = None) -> Result:
    result = Result()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for data in sse_data(resp):
                if data == "[DONE]":
                    continue
                payload = _json_decode(data)
                if payload.get("usage"):
                    result.output_tokens = payload["usage"].get("completion_tokens", 0)
                    result.prompt_tokens = payload["usage"].get("prompt_tokens", 0)
                if not payload.get("choices") or not payload["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                chunks += 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        if not result.prompt_tokens:
            result.prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
        result.ok = chunks > 0
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def pct(values, scale=1000.0):
        if not values:
            return {"mean": 0, "p50": 0, "p90": 0, "p99": 0}
        arr = np.asarray(values) * scale
        return {"mean": round(float(arr.mean()), 2), **{f"p{q}": round(float(np.percentile(arr, q)), 2) for q in (50, 90, 99)}}

    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": round(duration, 2),
        "output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_tok_s": round(out_tokens / duration, 1),
        "total_tok_s": round((in_tokens + out_tokens) / duration, 1),
        "ttft_ms": pct([r.ttft for r in ok]),
        "tpot_ms": pct(tpots),
        "itl_ms": pct([x for r in ok for x in r.itls]),
        "e2e_ms": pct([r.e2e for r in ok]),
    }


def print_summary(summary: dict) -> None:
    print(f"completed {summary['completed']} failed {summary['failed']} in {summary['duration_s']} s")
    print(f"request throughput {summary['request_throughput']} req/s, output {summary['output_tok_s']} tok/s, "
          f"total {summary['total_tok_s']} tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        print(f"{key:>8}: mean {s['mean']}  p50 {s['p50']}  p90 {s['p90']}  p99 {s['p99']}")
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ")
