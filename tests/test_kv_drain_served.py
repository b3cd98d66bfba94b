"""A worker drained (SIGTERM) mid-stream hands its requests to a worker of another host (a
tier file each: LLMBUS_KV_TIER_PATH, one deployment secret): the taker loads what the
drained worker computed over TCP from its tier instead of computing it again, and every
stream ends with the undisturbed run's text."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from deployment import Deployment, stream_texts
from llmbus.deploy.serve import spawn_service
from test_observability import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_drained_worker_s_requests_go_on_another_host_with_their_kv_moved(tiny_llama, tmp_path):
    from llmbus import LLM, SamplingParams

    prompts = [f"request {i}: " + "the weather today is fine and " * (6 + i) for i in range(6)]
    llm = LLM(str(tiny_llama), num_kv_blocks=256, max_model_len=1024)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))]
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in prompts)
    deployment = Deployment(str(tiny_llama), num_workers=0, env={"LLMBUS_KV_TRANSFER_SECRET": "one per deployment"})
    try:
        config = json.dumps({"kv_ip": "127.0.0.1"})
        for host in ("a", "b"):
            deployment.procs[host] = spawn_service(
                [*deployment.worker_argv, "--kv-offloading-size", "0.05", "--num-kv-blocks", "256",
                 "--max-model-len", "1024", "--kv-transfer-config", config, "--worker-id", f"worker-{host}"],
                env=dict(deployment.env, LLMBUS_KV_TIER_PATH=str(tmp_path / f"tier-{host}")))
        deployment.num_workers = 2
        deployment.wait_healthy()
        before = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        drained = []

        def drain_a() -> None:
            deployment.procs["a"].send_signal(signal.SIGTERM)
            drained.append(time.monotonic())

        assert asyncio.run(stream_texts(deployment.base_url, prompts, 48, on_started=drain_a)) == expected
        assert drained and deployment.procs["a"].wait(60) == 0
        time.sleep(1.0)  # (the stats of the last steps)
        after = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        loaded = metric(after, "llmbus:external_prefix_cache_hits_total") - metric(
            before, "llmbus:external_prefix_cache_hits_total")
        # (the requests worker a held went on on b with their prompts and outputs so far
        # loaded from a's tier: at least a prompt's worth of tokens moved, none recomputed)
        assert loaded >= min(len(llm.tokenizer.encode(p)) for p in prompts), loaded
        assert loaded <= prompt_tokens + len(prompts) * 48
    finally:
        deployment.close()
