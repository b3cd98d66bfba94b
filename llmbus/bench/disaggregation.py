"""`llmbus bench disaggregation`: the same traffic through `llmbus serve --workers 2` and
`llmbus serve --prefill-workers 1 --decode-workers 1`, one after the other on this machine:
`--streams` streams decoding while `--long-prompts` long prompts arrive one by one. Prints,
for each, the long prompts' TTFT and the decoding streams' inter-token latency (p50, p99),
and the ratios disaggregated / aggregated: what a prompt pays for the hand-over, and what
the streams gain from never sharing a step with a prompt. Both run with the same host KV tier
(--kv-offloading-size 1). (Their outputs are held equal by tests/test_disaggregation.py.)"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np

from llmbus.bench.streaming_client import one_request
from llmbus.deploy.serve import free_port
from llmbus.deploy.supervisor import stop_all
from llmbus.model_fetch import resolve_model

MODES = {"aggregated": ["--workers", "2"], "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1"]}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--streams", type=int, default=8, help="streams decoding throughout")
    parser.add_argument("--decode-tokens", type=int, default=192, help="tokens each stream generates")
    parser.add_argument("--long-prompts", type=int, default=4, help="long prompts arriving while they decode")
    parser.add_argument("--long-prompt-len", type=int, default=2048, help="their tokens (random ids)")
    parser.add_argument("--long-gap-s", type=float, default=1.0, help="seconds between them")
    parser.add_argument("--dtype", default="float32")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).json().get("workers") == 2
    except (httpx.HTTPError, ValueError):
        return False


async def _traffic(url: str, args, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    short = [rng.integers(0, vocab, 32).tolist() for _ in range(args.streams)]
    long = [rng.integers(0, vocab, args.long_prompt_len).tolist() for _ in range(args.long_prompts)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        streams = [asyncio.create_task(one_request(client, url + "/v1/completions", "bench", p, args.decode_tokens))
                   for p in short]
        await asyncio.sleep(1.0)  # (the streams decoding before the first long prompt)
        prompts = []
        for prompt in long:
            prompts.append(asyncio.create_task(one_request(client, url + "/v1/completions", "bench", prompt, 8)))
            await asyncio.sleep(args.long_gap_s)
        decoded, prefilled = await asyncio.gather(*streams), await asyncio.gather(*prompts)
    if not all(r.ok for r in [*decoded, *prefilled]):
        raise RuntimeError(next(r.error for r in [*decoded, *prefilled] if not r.ok))
    itls = np.array([g for r in decoded for g in r.itls]) * 1e3
    ttfts = np.array([r.ttft for r in prefilled]) * 1e3
    return {"long_prompt_ttft_ms": {"p50": round(float(np.median(ttfts)), 1), "max": round(float(ttfts.max()), 1)},
            "stream_itl_ms": {"p50": round(float(np.percentile(itls, 50)), 2),
                              "p99": round(float(np.percentile(itls, 99)), 2)}}


def run(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    model = str(resolve_model(args.model))
    vocab = AutoConfig.from_pretrained(model).vocab_size
    report = {}
    for mode, flags in MODES.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = subprocess.Popen(
            [sys.executable, "-m", "llmbus", "serve", "--model", model, "--served-model-name", "bench", "--port",
             str(port), "--dtype", args.dtype, "--kv-offloading-size", "1", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
        try:
            deadline = time.monotonic() + 300
            while not _healthy(url):
                if time.monotonic() > deadline or serve.poll() is not None:
                    raise RuntimeError(f"llmbus serve ({mode}) did not become healthy")
                time.sleep(0.5)
            report[mode] = asyncio.run(_traffic(url, args, vocab))
        finally:
            stop_all([serve], 60)
    agg, dis = report["aggregated"], report["disaggregated"]
    print(json.dumps({
        "model": args.model or "smollm2", "dtype": args.dtype, "streams": args.streams,
        "long_prompts": args.long_prompts, "long_prompt_len": args.long_prompt_len, **report,
        "ttft_ratio_disaggregated_over_aggregated": round(dis["long_prompt_ttft_ms"]["p50"]
                                                          / agg["long_prompt_ttft_ms"]["p50"], 2),
        "itl_p99_ratio_disaggregated_over_aggregated": round(dis["stream_itl_ms"]["p99"]
                                                             / agg["stream_itl_ms"]["p99"], 2),
    }, indent=1))
    return 0
