"""LoRA adapters (vLLM's enable_lora, LoRARequest, --lora-modules).

The oracle is PEFT's own model over transformers': greedy output under an adapter must
equal it token for token, for every dense family we load, adapters and the base model
mixed in one batch. Beside it: the scheduler never runs more adapters at once than the
worker has slots, prefix-cache blocks never cross adapters, and a bad adapter is a clear
error that leaves every other request alone.
"""

from __future__ import annotations

import json
import shutil

import pytest

from llmbus import LLM, LoRARequest, SamplingParams
from services.scheduler.core.kv_cache_manager import hash_root
from services.scheduler.core.scheduler import Scheduler
from services.worker.lora.manager import LoRAManager
from shared.config import LoRAConfig, SchedulerConfig
from shared.lora_request import parse_lora_modules
from shared.messages import EngineCoreRequest
from test_gateway import tokenizer  # noqa: F401 - a fixture
from tiny_models import (
    LORA_TARGETS_FUSED,
    build_lora_adapter,
    build_tiny_model,
    hf_greedy,
    peft_greedy,
    random_prompts,
)

PROMPTS = random_prompts([5, 17, 9], seed=3)
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-loras")
    a1 = build_lora_adapter(tiny_llama, root / "a1", seed=1)
    # another rank, fewer modules, rsLoRA's scaling
    a2 = build_lora_adapter(tiny_llama, root / "a2", seed=2, r=4, lora_alpha=8,
                            target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True)
    return (LoRARequest("a1", 1, str(a1)), LoRARequest("a2", 2, str(a2)),
            peft_greedy(tiny_llama, a1, PROMPTS, MAX_NEW), peft_greedy(tiny_llama, a2, PROMPTS, MAX_NEW))


def spy_steps(monkeypatch) -> list[list]:
    """Each step's adapters, one entry per request (None: the base model)."""
    steps = []
    real = LoRAManager.map_step

    def map_step(self, adapters, starts, ends):
        steps.append([a.request.lora_name if a is not None else None for a in adapters])
        return real(self, adapters, starts, ends)

    monkeypatch.setattr(LoRAManager, "map_step", map_step)
    return steps


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "granite", "gemma", "glm4", "arcee", "stablelm", "cohere", "cohere2"])
def test_each_family_under_two_adapters_and_none_in_one_batch_equals_peft(arch, tmp_path):
    base = build_tiny_model(tmp_path / "base", arch=arch, seed=4)
    # (Phi-3's adapters name its fused modules; GLM's its fused gate_up_proj, its q/k/v apart,
    # their rows reordered as the base weights' for its interleaved rotary; Arcee's MLP has no
    # gate, and only its down_proj is adapted)
    targets = {"phi3": LORA_TARGETS_FUSED, "glm4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                     "down_proj"],
               "arcee": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}.get(arch)
    a1 = build_lora_adapter(base, tmp_path / "a1", seed=1, target_modules=targets)
    a2 = build_lora_adapter(base, tmp_path / "a2", seed=2, r=4, lora_alpha=8,
                            target_modules={"phi3": ["qkv_proj"], "arcee": ["k_proj", "down_proj"]}.get(
                                arch, ["k_proj", "up_proj"]))
    if arch == "arcee":  # an adapter of its ungated up_proj is refused by name
        up = build_lora_adapter(base, tmp_path / "up", seed=3, target_modules=["up_proj"])
        with pytest.raises(ValueError, match="MLP without a gate"):
            LLM(str(base), enable_lora=True).generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("up", 9, str(up)))
    llm = LLM(str(base), max_model_len=256, enable_lora=True, max_loras=2)
    r1, r2 = LoRARequest("a1", 1, str(a1)), LoRARequest("a2", 2, str(a2))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 3, GREEDY, lora_request=[r1] * 3 + [r2] * 3
                                                        + [None] * 3)]
    want1, want2 = peft_greedy(base, a1, PROMPTS, MAX_NEW), peft_greedy(base, a2, PROMPTS, MAX_NEW)
    want0 = hf_greedy(base, PROMPTS, MAX_NEW)
    assert want1 != want0 and want2 != want0  # (the adapters change what is generated)
    assert got == want1 + want2 + want0


def test_llama_mixes_adapters_and_the_base_model_in_each_step(tiny_llama, llama_adapters, monkeypatch):
    r1, r2, want1, want2 = llama_adapters
    steps = spy_steps(monkeypatch)
    llm = LLM(str(tiny_llama), max_model_len=256, enable_lora=True, max_loras=2)
    got = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]] * 2, GREEDY,
                                                        lora_request=[r1, r2, None, None, r1, r2])]
    want0 = hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
    assert got == [want1[0], want2[1], want0[2], want0[0], want1[1], want2[2]]
    # the decode steps mixed all three (each request's own rows took its adapter)
    assert sum(set(step) == {"a1", "a2", None} for step in steps) >= MAX_NEW - 1


@pytest.mark.parametrize("slots_of_tokens", [[1, -1, 1, 1, -1], [0, 2, -1, 1, 2, 0], [2, 2, 2], [0]])
def test_a_stack_adds_each_tokens_own_adapter_and_nothing_to_the_base_models(slots_of_tokens):
    """The dense masked product (layers/lora.py) against each token's B @ A @ x, one by one:
    tokens of the base model (-1) get nothing, slots this step does not use add nothing."""
    import numpy as np
    import torch

    from services.worker.layers.lora import LoRAMapping, LoRAStack

    gen = torch.Generator().manual_seed(len(slots_of_tokens))
    mapping = LoRAMapping()
    stack = LoRAStack(mapping, 4, in_size=24, out_size=40, rank=8, dtype=torch.float64, device=torch.device("cpu"))
    stack.a.normal_(generator=gen)
    stack.b.normal_(generator=gen)
    x = torch.randn(len(slots_of_tokens), 24, generator=gen, dtype=torch.float64)
    base = torch.randn(len(slots_of_tokens), 40, generator=gen, dtype=torch.float64)
    mapping.set(np.array(slots_of_tokens), torch.device("cpu"))
    got = stack.add(x, base.clone())
    want = torch.stack([y if s < 0 else y + stack.b[s].T @ (stack.a[s] @ v)
                        for s, v, y in zip(slots_of_tokens, x, base)])
    torch.testing.assert_close(got, want)


def test_more_adapters_than_slots_take_turns_and_each_equals_peft(tiny_llama, llama_adapters, monkeypatch):
    r1, r2, want1, want2 = llama_adapters
    steps = spy_steps(monkeypatch)
    writes = []
    real_write = LoRAManager._write
    monkeypatch.setattr(LoRAManager, "_write",
                        lambda self, slot, adapter: (writes.append((slot, adapter.request.lora_name)),
                                                     real_write(self, slot, adapter)))
    llm = LLM(str(tiny_llama), max_model_len=256, enable_lora=True, max_loras=1)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, GREEDY, lora_request=[r1, r2, r1, r2, r1, r2])]
    assert got == [want1[0], want2[1], want1[2], want2[0], want1[1], want2[2]]
    assert all(len({a for a in step if a is not None}) == 1 for step in steps)
    # one slot, given to a1 then to a2 (a1's requests first, and together: they ran in turn)
    assert writes == [(0, "a1"), (0, "a2")]


def test_prefix_cache_blocks_never_cross_adapters(tiny_llama, llama_adapters):
    r1, _, _, _ = llama_adapters
    prompt = random_prompts([40], seed=9)[0]  # two full blocks of 16 to cache
    llm = LLM(str(tiny_llama), max_model_len=256, enable_lora=True)
    base = llm.generate([prompt], GREEDY)[0]
    under = llm.generate([prompt], GREEDY, lora_request=r1)[0]
    again = llm.generate([prompt], GREEDY, lora_request=r1)[0]
    assert base.outputs[0].token_ids == hf_greedy(tiny_llama, [prompt], MAX_NEW)[0]
    assert under.num_cached_tokens == 0  # the base model's blocks hold other keys and values
    assert under.outputs[0].token_ids == peft_greedy(tiny_llama, r1.lora_path, [prompt], MAX_NEW)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == under.outputs[0].token_ids


def test_an_adapter_with_speculative_decoding_equals_peft(tiny_llama, llama_adapters):
    r1, _, want1, _ = llama_adapters
    llm = LLM(str(tiny_llama), max_model_len=256, enable_lora=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    # repeated prompts give the n-gram proposer drafts to verify under the adapter
    prompts = [p * 3 for p in PROMPTS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts + PROMPTS, GREEDY, lora_request=[r1] * 6)]
    assert got == peft_greedy(tiny_llama, r1.lora_path, prompts, MAX_NEW) + want1
    assert llm.stats().spec_decode_num_draft_tokens > 0


def test_embeddings_under_an_adapter_are_the_adapted_models(tiny_llama, llama_adapters):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    r1, _, _, _ = llama_adapters
    llm = LLM(str(tiny_llama), max_model_len=256, enable_lora=True)
    got = llm.embed(PROMPTS[:2], lora_request=r1)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                                      r1.lora_path).eval()
    for prompt, out in zip(PROMPTS, got):
        with torch.no_grad():
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-4)


def _adapter_with(tmp_path, base, name, **options):
    return LoRARequest(name, 9, str(build_lora_adapter(base, tmp_path / name, **options)))


@pytest.mark.parametrize("make, says", [
    (lambda tmp, base: _adapter_with(tmp, base, "big", r=32), "rank 32, above --max-lora-rank 16"),
    (lambda tmp, base: _adapter_with(tmp, base, "dora", use_dora=True), "use_dora"),
    (lambda tmp, base: _adapter_with(tmp, base, "head", target_modules=["lm_head"]), "lm_head"),
    (lambda tmp, base: _adapter_with(tmp, base, "embed", target_modules=["embed_tokens"]), "embed_tokens"),
    (lambda tmp, base: LoRARequest("gone", 9, str(tmp / "nowhere")), "adapter_config.json not found"),
])
def test_a_bad_adapter_is_a_value_error_and_the_engine_goes_on(tiny_llama, llama_adapters, tmp_path, make, says):
    r1, _, want1, _ = llama_adapters
    llm = LLM(str(tiny_llama), max_model_len=256, enable_lora=True)
    with pytest.raises(ValueError, match=says):
        llm.generate(PROMPTS, GREEDY, lora_request=[r1, make(tmp_path, tiny_llama), None])
    assert not llm.scheduler.has_unfinished_requests()  # nothing of the batch was queued
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=r1)] == want1


def test_an_adapter_without_enable_lora_is_refused_by_name(tiny_llama, llama_adapters):
    llm = LLM(str(tiny_llama), max_model_len=256)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=llama_adapters[0])


def test_an_adapter_dropped_from_memory_and_gone_from_disk_fails_alone(tiny_llama, llama_adapters, tmp_path):
    """A request holds its adapter once read; one sent again (preempted) reads it anew."""
    r1, r2, want1, want2 = llama_adapters
    shutil.copytree(r1.lora_path, tmp_path / "a1")
    moved = LoRARequest("moved", 3, str(tmp_path / "a1"))
    llm = LLM(str(tiny_llama), max_model_len=256, enable_lora=True, max_loras=1, max_cpu_loras=1)
    results = llm.add_requests([PROMPTS[0], PROMPTS[1]], [GREEDY] * 2, lora_request=[moved, r2])
    llm.step()  # moved's request arrives at the runner (one slot: r2's waits)
    (tmp_path / "a1" / "adapter_model.safetensors").unlink()
    while llm.scheduler.has_unfinished_requests():
        llm.step()
    # r2's arrival dropped moved's host copy; its request had it and finished under it
    assert moved not in llm.runner.loras._read
    assert [r.outputs[0].token_ids for r in results] == [want1[0], want2[1]]
    with pytest.raises(ValueError, match="adapter_model.safetensors not found"):  # asked anew: read anew
        llm.generate(PROMPTS[0], GREEDY, lora_request=moved)


# ---- the scheduler's part ----------------------------------------------------------------------


def _request(rid: str, lora: LoRARequest | None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [5, 6, 7, 8], GREEDY, None, lora_request=lora)


def test_scheduler_runs_no_more_adapters_than_slots_and_lets_others_pass():
    x, y = LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y")
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), 64, 16, 100, max_loras=1)
    for rid, lora in [("a", x), ("b", y), ("c", x), ("d", None)]:
        scheduler.add_request(_request(rid, lora))
    first = scheduler.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["a", "c", "d"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]  # in its place, first once x is done
    stats = scheduler.make_stats()
    assert (stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters) == (1, ["x"], ["y"])
    scheduler.abort_requests(["a", "c"])
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["b"]


def test_scheduler_without_slots_rejects_an_adapter_naming_the_flag():
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), 64, 16, 100)
    with pytest.raises(ValueError, match="--enable-lora"):
        scheduler.add_request(_request("a", LoRARequest("x", 1, "/x")))


def test_block_hashes_start_apart_per_adapter_and_as_before_for_the_base_model():
    x, x_moved = LoRARequest("x", 1, "/x"), LoRARequest("x", 1, "/elsewhere")
    assert hash_root(False, None) is None and hash_root(True, None) == b"longrope:long"
    roots = {hash_root(False, x), hash_root(False, x_moved), hash_root(True, x), hash_root(False, None)}
    assert len(roots) == 4


# ---- naming adapters ---------------------------------------------------------------------------


def test_lora_modules_take_both_forms_and_check_each_folder(llama_adapters, tmp_path):
    r1, r2, _, _ = llama_adapters
    unweighted = tmp_path / "unweighted"
    unweighted.mkdir()
    shutil.copy(f"{r1.lora_path}/adapter_config.json", unweighted)
    modules = parse_lora_modules([f"one={r1.lora_path}", json.dumps({"name": "two", "path": r2.lora_path})])
    assert modules == {"one": LoRARequest("one", 1, r1.lora_path), "two": LoRARequest("two", 2, r2.lora_path)}
    for values, says in [([f"one={r1.lora_path}", f"one={r2.lora_path}"], "names 'one' twice"),
                         ([f"gone={tmp_path}"], "adapter_config.json not found"),
                         ([f"x={unweighted}"], "adapter_model.safetensors not found"),
                         (["nameonly"], "give name=path"),
                         (['{"name": "x"}'], "the JSON form")]:
        with pytest.raises(ValueError, match=says):
            parse_lora_modules(values)
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        parse_lora_modules([f"one={r1.lora_path}"], max_rank=4)


def test_lora_config_limits_are_checked():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=0)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3


def test_llmbus_serve_with_lora_modules_answers_each_adapter_as_peft_does(tiny_llama, llama_adapters, tmp_path):
    """What a user runs: `llmbus serve --enable-lora --lora-modules ...`, asked through the
    openai client for the base model and two adapters at once; an adapter whose weights went
    missing after start-up fails its own requests by name and nobody else's."""
    import asyncio

    import httpx
    import openai

    from deployment import llmbus_serve

    a1, a2, want1, want2 = llama_adapters
    broken = shutil.copytree(a1.lora_path, tmp_path / "broken")
    proc, url = llmbus_serve(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
         "--lora-modules", f"a1={a1.lora_path}", json.dumps({"name": "a2", "path": a2.lora_path}),
         f"broken={broken}"], tmp_path / "serve.log", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        (broken / "adapter_model.safetensors").unlink()  # start-up checked it; the worker reads it first here
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        assert {m["id"]: m.get("parent") for m in models} == {"tiny": None, "a1": "tiny", "a2": "tiny",
                                                                "broken": "tiny"}
        assert {m["id"]: m["root"] for m in models}["a2"] == a2.lora_path

        async def complete(model, prompt):
            out = await client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            assert out.model == model
            return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

        async def broken_one():
            with pytest.raises(openai.APIStatusError) as info:
                await client.completions.create(model="broken", prompt=PROMPTS[0], max_tokens=4)
            return info.value

        async def everyone():
            jobs = [complete(m, p) for m in ("a1", "a2", "tiny") for p in PROMPTS]
            error, *got = await asyncio.gather(broken_one(), *jobs)
            assert got == want1 + want2 + hf_greedy(tiny_llama, PROMPTS, MAX_NEW)
            assert "adapter_model.safetensors" in str(error.body), error.body
            with pytest.raises(openai.NotFoundError, match="a3"):
                await client.completions.create(model="a3", prompt="hello", max_tokens=4)
            # and the adapters still answer after the broken one failed
            assert await complete("a2", PROMPTS[1]) == want2[1]
            await loaded_at_run_time()
            return error

        async def lora_call(route, **body):
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                return await http.post(f"/v1/{route}_lora_adapter", json=body)

        async def loaded_at_run_time():
            """vLLM's runtime loading: the same folder given new weights and reloaded in
            place answers with the new ones (a new id: read again, no KV shared)."""
            late = shutil.copytree(a1.lora_path, tmp_path / "late")
            ok = await lora_call("load", lora_name="late", lora_path=str(late))
            assert ok.status_code == 200 and "late" in ok.text, ok.text
            assert [await complete("late", p) for p in PROMPTS] == want1
            again = await lora_call("load", lora_name="late", lora_path=str(late))
            assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name", again.text
            nowhere = await lora_call("load", lora_name="nowhere", lora_path=str(tmp_path / "nowhere"))
            assert nowhere.status_code == 400 and "adapter_config.json" in nowhere.text, nowhere.text
            big = _adapter_with(tmp_path, tiny_llama, "big", r=32)  # the workers take rank 16 at most
            over = await lora_call("load", lora_name="big", lora_path=big.lora_path)
            assert over.status_code == 400 and "rank 32, above --max-lora-rank 16" in over.text, over.text
            shutil.copy(f"{a2.lora_path}/adapter_config.json", late)
            shutil.copy(f"{a2.lora_path}/adapter_model.safetensors", late)
            ok = await lora_call("load", lora_name="late", lora_path=str(late), load_inplace=True)
            assert ok.status_code == 200, ok.text
            assert [await complete("late", p) for p in PROMPTS] == want2
            assert "late" in [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
            assert (await lora_call("unload", lora_name="late")).status_code == 200
            assert (await lora_call("unload", lora_name="late")).status_code == 404
            with pytest.raises(openai.NotFoundError, match="late"):
                await client.completions.create(model="late", prompt="hello", max_tokens=4)
            assert "late" not in [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]

        error = asyncio.run(everyone())
        # the operator's adapter is broken, not the client's request: a server error
        assert error.status_code == 500, error.body
    finally:
        proc.terminate()
        proc.wait(60)


def test_llmbus_serve_refuses_lora_modules_without_enable_lora(tiny_llama, llama_adapters):
    import subprocess
    import sys

    a1 = llama_adapters[0]
    done = subprocess.run([sys.executable, "-m", "llmbus", "serve", "--model", str(tiny_llama),
                           "--lora-modules", f"a1={a1.lora_path}"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--enable-lora" in done.stderr, done.stderr


def test_runtime_loading_is_off_unless_asked_and_each_bad_call_is_a_4xx(tokenizer, llama_adapters):
    from shared.config import GatewayConfig
    from test_gateway import gateway

    a1 = llama_adapters[0]
    closed, _ = gateway(tokenizer)
    with closed:
        assert closed.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": a1.lora_path}).status_code == 404
    client, engine = gateway(tokenizer, config=GatewayConfig("tiny", allow_runtime_lora_updating=True,
                                                             lora_modules=parse_lora_modules([f"a1={a1.lora_path}"])))
    with client:
        def load(**body):
            return client.post("/v1/load_lora_adapter", json=body)

        assert load(lora_name="b", lora_path=a1.lora_path).status_code == 200
        client.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
        assert engine.submitted[-1].lora_request == LoRARequest("b", 2, a1.lora_path)  # ids go on from the modules'
        for body, param in [({"lora_name": "tiny", "lora_path": a1.lora_path}, "lora_name"),
                            ({"lora_name": "c", "lora_path": a1.lora_path, "inplace": True}, "inplace"),
                            ({"lora_name": "c"}, "lora_path")]:
            bad = load(**body)
            assert (bad.status_code, bad.json()["error"]["param"]) == (400, param), bad.text
        # The workers' limits, as the scheduler reports them: refused at the load, not at a request.
        engine.max_lora_rank = 4
        over = load(lora_name="c", lora_path=a1.lora_path)
        assert (over.status_code, over.json()["error"]["param"]) == (400, "lora_path"), over.text
        assert "rank 8, above --max-lora-rank 4" in over.json()["error"]["message"]
        engine.max_lora_rank = 0
        none = load(lora_name="c", lora_path=a1.lora_path)
        assert none.status_code == 400 and "no worker serves adapters" in none.json()["error"]["message"], none.text
        engine.max_lora_rank = 16
        wrong_id = client.post("/v1/unload_lora_adapter", json={"lora_name": "a1", "lora_int_id": 7})
        assert wrong_id.status_code == 404, wrong_id.text
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
        gone = client.post("/v1/completions", json={"model": "a1", "prompt": "hi"})
        assert gone.status_code == 404 and "`b`" in gone.json()["error"]["message"], gone.text


def test_lora_requests_info_says_the_adapters_running_and_waiting_as_vllm_s_does():
    from services.gateway.metrics import GatewayMetrics
    from shared.messages import SchedulerStats

    metrics = GatewayMetrics("tiny")
    fleet = SchedulerStats.combine([
        SchedulerStats(max_lora=2, running_lora_adapters=["sql"], waiting_lora_adapters=["chat"]),
        SchedulerStats(max_lora=2, running_lora_adapters=["chat", "sql"])])
    fleet.scheduler_id = "s1"
    metrics.observe_stats(fleet)
    metrics.observe_stats(fleet)  # one sample, not one per observation
    samples = [line for line in metrics.render().decode().splitlines() if line.startswith("llmbus:lora_requests_info{")]
    assert len(samples) == 1, samples
    assert 'max_lora="4"' in samples[0] and 'running_lora_adapters="chat,sql"' in samples[0]
    assert 'waiting_lora_adapters="chat"' in samples[0]
    quiet = GatewayMetrics("tiny")
    quiet.observe_stats(SchedulerStats(scheduler_id="s1"))  # without --enable-lora: no sample
    assert "llmbus:lora_requests_info{" not in quiet.render().decode()
