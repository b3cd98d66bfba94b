"""`llmbus serve --data-parallel-size 2 --workers 2`, as a user runs it: two scheduler
shards, each with a worker of its own, gateways routing between them. Greedy streams equal
the offline engine's (one scheduler, one worker), both shards serve, and a shard's
scheduler SIGKILLed mid-stream loses no stream and comes back."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from deployment import llmbus_serve
from llmbus.deploy.serve import live_children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_STREAMS = 24
MAX_TOKENS = 40
PROMPTS = [f"request {i} of a burst: the weather today is" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    proc, url = llmbus_serve(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--data-parallel-size", "2", "--workers", "2",
         "--num-kv-blocks", "256", "--max-model-len", "1024"],
        tmp_path_factory.mktemp("dp") / "stderr.log")
    yield proc, url
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def offline_texts(tiny_llama) -> list[str]:
    """The oracle: one scheduler and one worker in this process."""
    from llmbus import LLM, SamplingParams

    llm = LLM(str(tiny_llama), num_kv_blocks=256, max_model_len=1024)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [out.outputs[0].text for out in outputs]


async def stream_all(base_url: str, on_all_started=None) -> list[str]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    started = 0

    async def one(prompt: str) -> str:
        nonlocal started
        text, first = "", True
        stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True,
                                                 max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            if first:
                first, started = False, started + 1
                if started == NUM_STREAMS and on_all_started is not None:
                    on_all_started()
        return text

    try:
        return await asyncio.gather(*(one(p) for p in PROMPTS))
    finally:
        await client.close()


def prompt_tokens_by_scheduler(url: str) -> dict[str, float]:
    """Prompt tokens each scheduler looked up in its prefix cache (every prompt it took)."""
    found: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        match = re.match(r'llmbus:prefix_cache_queries_total\{.*scheduler="([^"]+)".*\} (\S+)', line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def two_shards_serving(url: str) -> bool:
    try:
        health = httpx.get(url + "/health", timeout=5)
    except httpx.HTTPError:
        return False
    return health.status_code == 200 and health.json()["shards"] == {"0": 1, "1": 1}


def test_streams_equal_one_scheduler_s_and_both_shards_serve(served, offline_texts):
    proc, url = served
    assert httpx.get(url + "/health", timeout=5).json()["shards"] == {"0": 1, "1": 1}
    before = prompt_tokens_by_scheduler(url)
    assert asyncio.run(stream_all(url)) == offline_texts
    after = prompt_tokens_by_scheduler(url)
    served_some = [s for s, n in after.items() if n > before.get(s, 0.0)]
    assert len(served_some) == 2, after
    assert len(live_children(proc.pid, "scheduler")) == 2


def test_a_killed_shard_loses_no_stream_and_comes_back(served, offline_texts):
    proc, url = served
    schedulers = live_children(proc.pid, "scheduler")
    victim = schedulers[0]
    texts = asyncio.run(stream_all(url, lambda: victim.kill()))
    assert texts == offline_texts
    # (the kill landed mid-stream: the shard's requests were sent again, on it or elsewhere)
    assert re.search(r"shard \d.*resuming (its )?\d+ request", proc.log.read_text()), "no stream was resumed"
    wait_until(lambda: len(live_children(proc.pid, "scheduler")) == 2
               and victim not in live_children(proc.pid, "scheduler"), 60, "the shard was not restarted")
    wait_until(lambda: two_shards_serving(url), 120, "the shard did not get its worker back")
    assert asyncio.run(stream_all(url)) == offline_texts  # and it serves the same afterwards
    assert proc.poll() is None
