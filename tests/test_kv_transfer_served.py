"""Prefill and decode workers as on two hosts, started by hand as a deployment across hosts
starts them (`llmbus worker`, a tier file each: LLMBUS_KV_TIER_PATH), one secret for the
deployment: every prompt prefilled on the first is decoded on the second with its KV loaded
over TCP from the first's tier. Greedy streams equal the offline engine's, the decode
worker's loads count as vLLM's external prefix-cache hits, and its step log shows no
prompt token computed there."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from deployment import Deployment, stream_texts
from llmbus.deploy.serve import spawn_service
from test_observability import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_prompt_prefilled_on_one_host_decodes_on_another_with_its_kv_moved(tiny_llama, tmp_path):
    from llmbus import LLM, SamplingParams

    prompts = [f"request {i}: " + "the weather today is fine and " * (3 + i) for i in range(6)]
    llm = LLM(str(tiny_llama), num_kv_blocks=256, max_model_len=1024)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    deployment = Deployment(str(tiny_llama), num_workers=0, env={"LLMBUS_KV_TRANSFER_SECRET": "one per deployment"})
    try:
        for role in ("kv_producer", "kv_consumer"):
            config = json.dumps({"kv_role": role, "kv_ip": "127.0.0.1"})
            deployment.procs[role] = spawn_service(
                [*deployment.worker_argv, "--kv-offloading-size", "0.05", "--num-kv-blocks", "256",
                 "--max-model-len", "1024", "--kv-transfer-config", config],
                env=dict(deployment.env, LLMBUS_KV_TIER_PATH=str(tmp_path / f"tier-{role}"),
                         LLMBUS_STEP_LOG=str(tmp_path / f"steps-{role}.jsonl")))
        deployment.num_workers = 2
        deployment.wait_healthy()
        before = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        assert asyncio.run(stream_texts(deployment.base_url, prompts, 16)) == expected
        time.sleep(1.0)  # (the stats of the last steps)
        after = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        loaded = metric(after, "llmbus:external_prefix_cache_hits_total") - metric(
            before, "llmbus:external_prefix_cache_hits_total")
        assert loaded >= sum(len(llm.tokenizer.encode(p)) for p in prompts) - len(prompts)
        decode_steps = [json.loads(line) for line in (tmp_path / "steps-kv_consumer.jsonl").read_text().splitlines()]
        assert decode_steps and all(step["tokens"] == step["decodes"] for step in decode_steps)
    finally:
        deployment.close()
