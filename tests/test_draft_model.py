"""Speculative decoding with a draft model (`{"method": "draft_model", "model": FOLDER}`):
greedy output equals transformers' whatever the draft (the target as its own draft, whose
every draft is accepted; a different model, whose drafts mostly are not), through chunked
prefill and preemption; seeded sampling is the run's without speculation; the draft's KV
cache comes out of the worker's budget; a draft of another vocabulary is refused by name;
and `llmbus serve --speculative-config` streams the offline text through the openai client."""

from __future__ import annotations

import json
import shutil

import pytest

from llmbus import LLM, SamplingParams
from tiny_models import build_tiny_model, hf_greedy

TEXTS = ["the cat sat on the mat, the cat sat on the mat, the cat", "1 2 3 4 5 1 2 3 4 5 1 2 3",
         "abc abc abc abc", "Paged attention keeps"]
MAX_TOKENS = 40


def spec(draft, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Another random model of the same shape and vocabulary: its drafts are mostly wrong."""
    return build_tiny_model(tmp_path_factory.mktemp("other-draft"), "llama", seed=7)


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llama)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"num_kv_blocks": 14, "enable_prefix_caching": False},  # preemption
], ids=["plain", "chunked", "preempted"])
def test_greedy_with_the_target_as_its_own_draft_equals_transformers_and_every_draft_is_accepted(
        tiny_llama, prompts, options):
    llm = LLM(str(tiny_llama), speculative_config=spec(tiny_llama), **options)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    stats = llm.stats()
    # The same model drafting: every draft is what the target samples (a draft whose KV the
    # catch-up got wrong, at a wrong position or block, would be rejected somewhere).
    assert stats.spec_decode_num_draft_tokens > 2 * len(prompts)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    if "num_kv_blocks" in options:
        assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0  # every block back


def test_greedy_with_a_wrong_draft_is_still_transformers(tiny_llama, other_draft, prompts):
    llm = LLM(str(tiny_llama), speculative_config=spec(other_draft))
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    stats = llm.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens / 2


def test_seeded_sampling_is_the_run_without_speculation(tiny_llama, prompts):
    params = [SamplingParams(temperature=0.05, top_p=0.9, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_llama)).generate(prompts, params)]
    llm = LLM(str(tiny_llama), speculative_config=spec(tiny_llama, 3))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.stats().spec_decode_num_accepted_tokens > 0


def test_the_drafts_kv_cache_comes_out_of_the_workers_budget(tiny_llama):
    """The draft's blocks sit under the target's block ids: a budget holds fewer of them
    (half as many with the target drafting itself)."""
    budget = 1 << 20
    alone = LLM(str(tiny_llama), kv_cache_memory_bytes=budget).runner.num_blocks
    drafted = LLM(str(tiny_llama), kv_cache_memory_bytes=budget, speculative_config=spec(tiny_llama)).runner
    assert drafted.num_blocks == alone // 2
    assert drafted.proposer.kv_caches[0].shape[1] == drafted.num_blocks + 1  # (the pad block too)


def test_a_draft_of_another_vocabulary_or_no_draft_is_refused_by_name(tiny_llama, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] += 64
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocabulary of .* tokens, the target's"):
        LLM(str(tiny_llama), speculative_config=spec(other))
    with pytest.raises(ValueError, match="speculative_config model: model .* is neither a known model"):
        LLM(str(tiny_llama), speculative_config=spec(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="draft_model takes a `model`"):
        LLM(str(tiny_llama), speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="ngram takes no `model`"):
        LLM(str(tiny_llama), speculative_config={"method": "ngram", "model": str(tiny_llama)})


def test_served_with_a_draft_model_streams_the_offline_text(tiny_llama, tmp_path):
    import httpx
    import openai

    from deployment import llmbus_serve

    expected = [o.outputs[0].text for o in LLM(str(tiny_llama)).generate(
        TEXTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    proc, url = llmbus_serve(["--model", str(tiny_llama), "--served-model-name", "tiny",
                              "--speculative-config", json.dumps(spec(tiny_llama))], tmp_path / "stderr.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for text, want in zip(TEXTS, expected):
            stream = client.completions.create(model="tiny", prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(chunk.choices[0].text for chunk in stream) == want
        metrics = httpx.get(url + "/metrics", timeout=5).text
        accepted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("llmbus:spec_decode_num_accepted_tokens_total{")]
        assert accepted and sum(accepted) > 0
    finally:
        proc.terminate()
        proc.wait(60)


def test_probabilistic_drafts_take_the_targets_draws_and_raise_acceptance_at_temperature(tiny_llama, prompts):
    """draft_sample_method "probabilistic": a seeded request's draft is drawn from the
    drafter's distribution with the draw the target takes at that position. The target
    drafting itself then proposes what it will sample (nearly every draft accepted, where
    argmax drafts are accepted only when the draw lands on the argmax); the output is the
    run's without speculation either way."""
    params = [SamplingParams(temperature=1.0, seed=31 + i, max_tokens=MAX_TOKENS, ignore_eos=True, top_k=40,
                             presence_penalty=0.2) for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_llama)).generate(prompts, params)]
    rates = {}
    for method in ("greedy", "probabilistic"):
        llm = LLM(str(tiny_llama), speculative_config={**spec(tiny_llama, 3), "draft_sample_method": method})
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, method
        stats = llm.stats()
        rates[method] = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert rates["probabilistic"] > 0.95 and rates["greedy"] < 0.8, rates
