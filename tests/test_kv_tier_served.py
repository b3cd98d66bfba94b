"""`llmbus serve --workers 2 --kv-offloading-size`, as a user runs it: a prompt's blocks
outlive the worker that computed them. A worker SIGTERMed mid-stream hands its requests
over with their KV: the streams end with the text of an undisturbed run, and the worker that
takes them computes none of their tokens again. Both workers SIGKILLed in turn (their pools
gone), a prompt asked again is loaded from the host's tier on a worker that never computed
it (vLLM's external_prefix_cache_hits counts it) with the same text; the tier's file goes
when the deployment stops."""

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


def wait_for_two_workers(url: str, proc, gone) -> None:
    deadline = time.monotonic() + 120
    while True:
        workers = live_children(proc.pid, "worker")
        try:
            health = httpx.get(url + "/health", timeout=5).json()
        except httpx.HTTPError:
            health = {}
        if len(workers) == 2 and gone not in workers and health.get("workers") == 2:
            return
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.3)


def test_a_draining_worker_hands_its_streams_over_with_their_kv(tiny_llama, tmp_path):
    import asyncio

    from llmbus import LLM, SamplingParams

    prompts = [f"stream {i}: " + "the river runs past the mill and on " * (6 + i % 3) for i in range(8)]
    llm = LLM(str(tiny_llama), num_kv_blocks=256, max_model_len=1024)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))]
    step_log = tmp_path / "steps.jsonl"
    proc, url = llmbus_serve(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--workers", "2", "--num-kv-blocks", "256",
         "--max-model-len", "1024", "--kv-offloading-size", "0.05"], tmp_path / "stderr.log",
        env={"LLMBUS_STEP_LOG": str(step_log)})
    drained_at = []
    try:
        import openai

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        victim = live_children(proc.pid, "worker")[0]

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
        steps = [json.loads(line) for line in step_log.read_text().splitlines()]
        taker = [s for s in steps if s["pid"] != victim.pid and s["start_ns"] > drained_at[0]]
        assert taker and all(s["tokens"] == s["decodes"] for s in taker), "a handed-over token was computed again"
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_prefix_outlives_the_workers_that_computed_it(tiny_llama, tmp_path):
    proc, url = llmbus_serve(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--workers", "2", "--num-kv-blocks", "128",
         "--max-model-len", "1024", "--kv-offloading-size", "0.05"], tmp_path / "stderr.log")
    try:
        prompt = random_prompts([600], seed=3)[0]
        first = complete(url, prompt)
        assert metric(url, "external_prefix_cache_hits") == 0
        for victim in live_children(proc.pid, "worker"):  # every pool that could hold it, gone
            victim.kill()
            wait_for_two_workers(url, proc, victim)
        assert complete(url, prompt) == first
        assert metric(url, "external_prefix_cache_hits") == 37 * 16  # every full block but the last token's
        nats_url = re.search(r"\(NATS (\S+)\)", proc.banner).group(1)
        tier = Path(tier_path(nats_url, Subjects("tiny").prefix, 0))
        assert tier.exists()
    finally:
        proc.terminate()
        proc.wait(60)
    assert not tier.exists()
