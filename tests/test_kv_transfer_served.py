"""Workers as on two hosts, started by hand as a deployment across hosts starts them
(`llmbus worker`, a tier file each: LLMBUS_KV_TIER_PATH), one secret for the deployment.
Prefill and decode workers: every prompt prefilled on the first is decoded on the second
with its KV loaded over TCP from the first's tier; greedy streams equal the offline
engine's, the decode worker's loads count as vLLM's external prefix-cache hits, and its
step log shows no prompt token computed there. A worker drained (SIGTERM) mid-stream: the
other takes its requests with what it computed loaded from its tier (which it serves a
while after it leaves), every stream the undisturbed run's text."""

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


def two_hosts(model, tmp_path, roles: dict[str, str], prompts: list[str], max_tokens: int,
              worker_args: tuple[str, ...] = ()):
    """(a deployment whose two workers each have a host tier of their own, named by `roles`
    (name -> kv_role), the offline engine's greedy texts of `prompts`, the engine)."""
    from llmbus import LLM, SamplingParams

    llm = LLM(str(model), num_kv_blocks=256, max_model_len=1024)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]
    deployment = Deployment(str(model), num_workers=0, env={"LLMBUS_KV_TRANSFER_SECRET": "one per deployment"})
    try:
        for name, role in roles.items():
            config = json.dumps({"kv_role": role, "kv_ip": "127.0.0.1"})
            deployment.procs[name] = spawn_service(
                [*deployment.worker_argv, "--kv-offloading-size", "0.05", "--num-kv-blocks", "256",
                 "--max-model-len", "1024", "--kv-transfer-config", config, "--worker-id", name, *worker_args],
                env=dict(deployment.env, LLMBUS_KV_TIER_PATH=str(tmp_path / f"tier-{name}"),
                         LLMBUS_STEP_LOG=str(tmp_path / f"steps-{name}.jsonl")))
        deployment.num_workers = 2
        deployment.wait_healthy()
    except BaseException:
        deployment.close()
        raise
    return deployment, expected, llm


def loaded_tokens(deployment, before: str) -> float:
    """Tokens the workers loaded from tiers since the /metrics text `before`."""
    time.sleep(1.0)  # (the stats of the last steps)
    after = httpx.get(deployment.base_url + "/metrics", timeout=10).text
    return metric(after, "llmbus:external_prefix_cache_hits_total") - metric(
        before, "llmbus:external_prefix_cache_hits_total")


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks"])
def test_a_prompt_prefilled_on_one_host_decodes_on_another_with_its_kv_moved(tiny_llama, tmp_path, ranks):
    """Two ranks a worker: each rank of the decode worker fetches its own heads of the slots
    from the prefill worker's rank 0, which serves its ranks' files (float32: two ranks'
    text is one rank's)."""
    prompts = [f"request {i}: " + "the weather today is fine and " * (3 + i) for i in range(6)]
    deployment, expected, llm = two_hosts(tiny_llama, tmp_path, {"kv_producer": "kv_producer",
                                                                 "kv_consumer": "kv_consumer"}, prompts, 16,
                                          ("--tensor-parallel-size", str(ranks)))
    try:
        before = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        assert asyncio.run(stream_texts(deployment.base_url, prompts, 16)) == expected
        loaded = loaded_tokens(deployment, before)
        assert loaded >= sum(len(llm.tokenizer.encode(p)) for p in prompts) - len(prompts)
        decode_steps = [json.loads(line) for line in (tmp_path / "steps-kv_consumer.jsonl").read_text().splitlines()]
        assert decode_steps and all(step["tokens"] == step["decodes"] for step in decode_steps)
    finally:
        deployment.close()


def test_a_drained_worker_s_requests_go_on_another_host_with_their_kv_moved(tiny_llama, tmp_path):
    prompts = [f"request {i}: " + "the weather today is fine and " * (6 + i) for i in range(6)]
    deployment, expected, llm = two_hosts(tiny_llama, tmp_path, {"a": "kv_both", "b": "kv_both"}, prompts, 48)
    try:
        before = httpx.get(deployment.base_url + "/metrics", timeout=10).text
        drained = []

        def drain_a() -> None:
            deployment.procs["a"].send_signal(signal.SIGTERM)
            drained.append(time.monotonic())

        assert asyncio.run(stream_texts(deployment.base_url, prompts, 48, on_started=drain_a)) == expected
        assert drained and deployment.procs["a"].wait(60) == 0
        loaded = loaded_tokens(deployment, before)
        # (the requests worker a held went on on b with their prompts and outputs so far
        # loaded from a's tier: at least a prompt's worth of tokens moved, none recomputed;
        # before a drained worker kept serving its tier, none was)
        assert loaded >= min(len(llm.tokenizer.encode(p)) for p in prompts), loaded
        assert loaded <= sum(len(llm.tokenizer.encode(p)) for p in prompts) + len(prompts) * 48
    finally:
        deployment.close()
