"""Greedy output of the whole engine is token-identical to transformers on the same weights,
however the scheduler slices the work: plain, chunked prefill, prefix hits, preemption."""

import pytest

from llmbus import LLM, SamplingParams
from tiny_models import hf_greedy, random_prompts

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


PROMPTS = random_prompts([1, 5, 16, 17, 33, 64, 100])


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_reference(request, tiny_llama, tiny_qwen2):
    folder = tiny_llama if request.param == "llama" else tiny_qwen2
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW)


def generate_ids(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_batch_of_different_lengths_matches_transformers(model_and_reference):
    folder, reference = model_and_reference
    llm = LLM(str(folder))
    assert generate_ids(llm, PROMPTS) == reference


def test_chunked_prefill_matches_transformers(model_and_reference):
    folder, reference = model_and_reference
    llm = LLM(str(folder), max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert generate_ids(llm, PROMPTS) == reference


def test_shared_prefixes_hit_the_cache_and_match_transformers(model_and_reference):
    folder, _ = model_and_reference
    prefix = random_prompts([48], seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 9, 20, 1], seed=8)]
    reference = hf_greedy(folder, prompts, MAX_NEW)
    llm = LLM(str(folder), block_size=16)
    # First request alone fills the cache; the others then find its 3 full prefix blocks.
    first = generate_ids(llm, prompts[:1])
    rest = generate_ids(llm, prompts[1:])
    assert first + rest == reference
    stats = llm.stats()
    assert stats.prefix_cache_hits >= 3 * 48
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)


def test_whole_prompt_cached_still_computes_last_token(model_and_reference):
    folder, reference = model_and_reference
    llm = LLM(str(folder), block_size=16)
    prompt = PROMPTS[4]  # 33 tokens: 2 full blocks
    assert generate_ids(llm, [prompt]) == [reference[4]]
    hits_before = llm.stats().prefix_cache_hits
    assert generate_ids(llm, [prompt]) == [reference[4]]
    assert llm.stats().prefix_cache_hits - hits_before == 32


def test_preemption_under_tiny_cache_gives_identical_output(model_and_reference):
    folder, reference = model_and_reference
    llm = LLM(str(folder), num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    assert generate_ids(llm, PROMPTS) == reference
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert llm.scheduler.kv_cache_manager.block_pool.num_free_blocks == 12
    assert llm.runner.block_table.num_rows_in_use == 0  # each preempted request's row freed as it came back


def test_preemption_with_prefix_caching_and_chunking_matches(model_and_reference):
    folder, reference = model_and_reference
    llm = LLM(str(folder), num_kv_blocks=12, block_size=16, max_num_batched_tokens=24)
    assert generate_ids(llm, PROMPTS) == reference
    assert llm.stats().num_preemptions > 0


def test_priority_scheduling_under_preemption_matches(model_and_reference):
    """vLLM's priority policy: other admission and preemption orders, the same tokens."""
    folder, reference = model_and_reference
    llm = LLM(str(folder), num_kv_blocks=12, block_size=16, scheduling_policy="priority")
    priority = [3, 0, 2, 1, 0, 3, 1]
    outputs = llm.generate(PROMPTS, GREEDY, priority=priority)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.stats().num_preemptions > 0


def test_block_size_32_matches(model_and_reference):
    folder, reference = model_and_reference
    llm = LLM(str(folder), block_size=32, max_num_batched_tokens=40)
    assert generate_ids(llm, PROMPTS) == reference


def test_every_block_is_free_after_all_requests_finish(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=20)
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3, max_tokens=10))
    pool = llm.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert llm.runner.requests == {}
