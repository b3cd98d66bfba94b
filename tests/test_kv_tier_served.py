"""`llmbus serve --workers 2 --kv-offloading-size`, as a user runs it: a prompt's blocks
outlive the worker that computed them (one deployment for both tests). A worker SIGTERMed
mid-stream hands its requests over with their KV: the streams end with the text of an
undisturbed run, and the worker that takes them computes none of their tokens again. The
worker that computed a prompt SIGKILLed (its pool gone), the prompt asked again is loaded
from the host's tier on the other worker (vLLM's external_prefix_cache_hits counts it) with
the same text; the tier's file goes when the deployment stops."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from deployment import llmbus_serve
from llmbus.deploy.serve import live_children
from shared.bus import Subjects
from shared.kv_tier_files import tier_path
from tiny_models import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def complete(url: str, prompt: list[int]) -> str:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    return client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=16,
                                     extra_body={"ignore_eos": True}).choices[0].text


def metric(url: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^llmbus:{name}_total{{[^}}]*}} (\S+)$",
                                                        httpx.get(url + "/metrics", timeout=10).text, re.M))


def steps_of(proc) -> list[dict]:
    return [json.loads(line) for line in proc.step_log.read_text().splitlines()]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tier")
    proc, url = llmbus_serve(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--workers", "2", "--num-kv-blocks", "256",
         "--max-model-len", "1024", "--kv-offloading-size", "0.05"], folder / "stderr.log",
        env={"LLMBUS_STEP_LOG": str(folder / "steps.jsonl")})
    proc.step_log = folder / "steps.jsonl"
    yield proc, url
    if proc.poll() is None:
        proc.terminate()
        proc.wait(60)


def test_a_draining_worker_hands_its_streams_over_with_their_kv(served, tiny_llama):
    import asyncio

    import openai

    from llmbus import LLM, SamplingParams

    proc, url = served
    prompts = [f"stream {i}: " + "the river runs past the mill and on " * (6 + i % 3) for i in range(8)]
    llm = LLM(str(tiny_llama), num_kv_blocks=256, max_model_len=1024)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    victim = live_children(proc.pid, "worker")[0]
    drained_at = []

    async def one(prompt: str) -> str:
        text, tokens = "", 0
        stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True,
                                                 max_tokens=48, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            tokens += 1
            if tokens == 8 and not drained_at:
                drained_at.append(time.time_ns())
                victim.terminate()  # SIGTERM: it drains
        return text

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(main()) == expected
    log = proc.log.read_text()
    handed = re.search(r"draining: handing (\d+) running request", log)
    assert handed and int(handed.group(1)) > 0, "the drain found no running request"
    assert "its requests handed over with their KV" in log
    taker = [s for s in steps_of(proc) if s["pid"] != victim.pid and s["start_ns"] > drained_at[0]]
    assert taker and all(s["tokens"] == s["decodes"] for s in taker), "a handed-over token was computed again"


def test_a_prefix_outlives_the_worker_that_computed_it(served):
    proc, url = served
    deadline = time.monotonic() + 120
    while httpx.get(url + "/health", timeout=5).json().get("workers") != 2:  # (the drained one, back)
        assert time.monotonic() < deadline, "the drained worker did not come back"
        time.sleep(0.3)
    prompt = random_prompts([600], seed=3)[0]
    hits = metric(url, "external_prefix_cache_hits")
    first = complete(url, prompt)
    assert metric(url, "external_prefix_cache_hits") == hits
    computed_by = next(s["pid"] for s in reversed(steps_of(proc)) if s["tokens"] >= 600)
    victim = next(w for w in live_children(proc.pid, "worker") if w.pid == computed_by)
    victim.kill()  # its pool, and the prompt's blocks in it, gone
    while "removed (no heartbeat" not in proc.log.read_text():
        assert time.monotonic() < deadline, "the killed worker was not noticed"
        time.sleep(0.2)
    assert complete(url, prompt) == first
    assert metric(url, "external_prefix_cache_hits") - hits == 37 * 16  # every full block but the last token's
    nats_url = re.search(r"\(NATS (\S+)\)", proc.banner).group(1)
    tier = Path(tier_path(nats_url, Subjects("tiny").prefix, 0))
    assert tier.exists()
    proc.terminate()
    proc.wait(60)
    assert not tier.exists()
