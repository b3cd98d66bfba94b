"""`llmbus serve --prefill-workers 1 --decode-workers 1`, as a user runs it: prompts are
prefilled on the prefill worker, which streams their first token, and decoded on the decode
worker, their KV (the last, partial block too) moved through the host tier. Greedy streams
equal the offline engine's, and the decode worker's step log shows no prompt token computed
there: every row of its steps is a decode. The prefill worker SIGKILLed mid-stream: every
stream completes with the same text (the decode worker prefills while it is gone); streams
dropped by their clients mid-hand-over leave no block held on either worker."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from deployment import llmbus_serve, stream_texts
from llmbus.deploy.serve import live_children

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [f"request {i}: " + "the weather today is fine and " * (3 + i) for i in range(8)]
MAX_TOKENS = 24


async def stream_all(base_url: str, prompts: list[str], on_first_token=None) -> list[str]:
    return await stream_texts(base_url, prompts, MAX_TOKENS, on_first_token, started_before_call=1)


def offline_texts(model, prompts: list[str]) -> list[str]:
    from llmbus import LLM, SamplingParams

    llm = LLM(str(model), num_kv_blocks=256, max_model_len=1024)
    return [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd")
    proc, url = llmbus_serve(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--prefill-workers", "1", "--decode-workers", "1",
         # (64 tokens a step: prompts take several steps to prefill, so a kill finds some mid-way)
         "--num-kv-blocks", "512", "--max-model-len", "1024", "--max-num-batched-tokens", "64"], folder / "stderr.log",
        env={"LLMBUS_STEP_LOG": str(folder / "steps.jsonl")})
    proc.step_log = folder / "steps.jsonl"
    yield proc, url
    proc.terminate()
    proc.wait(60)


def workers_by_role(proc) -> dict[str, object]:
    return {json.loads(w.environ()["LLMBUS_KV_TRANSFER_CONFIG"])["kv_role"]: w
            for w in live_children(proc.pid, "worker")}


def test_prefill_and_decode_on_their_own_workers(served, tiny_llama):
    proc, url = served
    roles = {role: worker.pid for role, worker in workers_by_role(proc).items()}
    assert asyncio.run(stream_all(url, PROMPTS)) == offline_texts(tiny_llama, PROMPTS)
    steps = [json.loads(line) for line in proc.step_log.read_text().splitlines()]
    decode = [s for s in steps if s["pid"] == roles["kv_consumer"]]
    prefill = [s for s in steps if s["pid"] == roles["kv_producer"]]
    assert decode and prefill
    assert all(s["tokens"] == s["decodes"] for s in decode), "a prompt token was computed on the decode worker"
    assert sum(s["sampled"] for s in decode) == len(PROMPTS) * (MAX_TOKENS - 1)  # all but each first token
    assert sum(s["sampled"] for s in prefill) == len(PROMPTS)  # the first tokens, streamed from there
    assert sum(s["tokens"] - s["decodes"] for s in prefill) > 0


def test_streams_dropped_mid_hand_over_leave_both_pools_empty(served, tiny_llama):
    proc, url = served
    prompts = [f"dropped {i}: " + "clouds over the hills " * (6 + i % 4) for i in range(24)]

    async def one(i: int, prompt: str) -> str | None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "temperature": 0}
        text = ""
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                        if i % 2:
                            return None  # gone after its first token: its request is being handed over
        return text

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    texts = asyncio.run(main())
    kept = offline_texts(tiny_llama, prompts[::2])
    assert texts[::2] == kept

    def idle() -> bool:
        text = httpx.get(url + "/metrics", timeout=5).text
        return all(sum(float(m) for m in re.findall(rf"^llmbus:{name}{{[^}}]*}} (\S+)$", text, re.M)) == 0
                   for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))

    deadline = time.monotonic() + 5
    while not idle():
        assert time.monotonic() < deadline, "a pool kept blocks of dropped requests"
        time.sleep(0.2)


def test_a_killed_prefill_worker_loses_no_stream(served, tiny_llama):
    proc, url = served
    prompts = [f"stream {i} of 24: " + "a long day of rain and wind " * (8 + i % 5) for i in range(24)]
    victim = workers_by_role(proc)["kv_producer"]
    assert asyncio.run(stream_all(url, prompts, victim.kill)) == offline_texts(tiny_llama, prompts)
    moved = re.findall(r"worker \S+ removed \(no heartbeat[^)]*\); moving (\d+) request", proc.log.read_text())
    assert moved and int(moved[0]) > 0, "the kill found no request on the prefill worker"
