"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's completions with echo and logprobs)
equal transformers' log-softmax over the same prompt, however the scheduler slices it:
chunked prefill, a prompt whose blocks are cached, preemption, n choices; and how many
a request may ask for (vLLM's --max-logprobs, -1 the whole vocabulary)."""

import pytest
import torch

from llmbus import LLM, SamplingParams
from tiny_models import random_prompts

PROMPTS = random_prompts([1, 2, 17, 40, 70], seed=5)
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Per prompt, each token's (logprob, rank, top ids, top logprobs) after the ones before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    out = []
    for prompt in PROMPTS:
        with torch.no_grad():
            logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        rows = []
        for j in range(1, len(prompt)):
            row, chosen = logprobs[j - 1], logprobs[j - 1, prompt[j]]
            top = row.topk(TOP)
            rows.append((chosen.item(), int((row > chosen).sum()) + 1, top.indices.tolist(), top.values.tolist()))
        out.append(rows)
    return out


def check(outputs, reference) -> None:
    for prompt, output, expected in zip(PROMPTS, outputs, reference, strict=True):
        entries = output.prompt_logprobs  # vLLM's: per prompt token but the first, token id -> Logprob
        assert len(entries) == len(prompt) and entries[0] is None
        got, want = [], []
        for token, entry, (lp, rank, ids, top) in zip(prompt[1:], entries[1:], expected, strict=True):
            assert next(iter(entry)) == token and entry[token].rank == rank  # the prompt's token first
            assert [t for t, v in sorted(entry.items(), key=lambda kv: kv[1].rank) if v.rank <= TOP] == ids
            assert len(entry) == TOP + (rank > TOP)  # (one entry for a token among the top-k)
            got.append([entry[token].logprob, *(entry[t].logprob for t in ids)])
            want.append([lp, *top])
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-4, atol=1e-4)


PARAMS = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
CASES = {
    "batch": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "preemption": {"num_kv_blocks": 8, "block_size": 16, "max_num_batched_tokens": 32},
}


@pytest.mark.parametrize("case", CASES)
def test_prompt_logprobs_equal_transformers(tiny_llama, reference, case):
    llm = LLM(str(tiny_llama), **CASES[case])
    check(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    if case == "preemption":
        assert llm.stats().num_preemptions > 0


def test_a_cached_prompt_is_computed_whole_for_its_logprobs(tiny_llama, reference):
    llm = LLM(str(tiny_llama))
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate(PROMPTS, plain, use_tqdm=False)  # fills the prefix cache
    again = llm.generate(PROMPTS, plain, use_tqdm=False)
    assert max(o.num_cached_tokens for o in again) > 0 and all(o.prompt_logprobs is None for o in first)
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    check(out, reference)
    assert [o.num_cached_tokens for o in out] == [0] * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in first]


def test_n_choices_share_their_prompt_s_logprobs(tiny_llama, reference):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=TOP)
    out = LLM(str(tiny_llama)).generate(PROMPTS, params, use_tqdm=False)
    check(out, reference)
    assert all(len(o.outputs) == 2 for o in out)


def test_prompt_logprobs_out_of_range_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="prompt_logprobs must be -1"):
        SamplingParams(prompt_logprobs=-2)
    llm = LLM(str(tiny_llama), max_logprobs=4)  # vLLM's --max-logprobs (default 20)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match="greater than max allowed: 4"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, **{field: 5}), use_tqdm=False)
        with pytest.raises(ValueError, match=f"logprobs of {llm.runner.vocab_size},"):  # -1: the vocabulary
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, **{field: -1}), use_tqdm=False)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=4), use_tqdm=False)[0].outputs[0].logprobs


def test_minus_one_gives_the_whole_vocabulary_under_max_logprobs_minus_one(tiny_llama):
    """vLLM's -1, for prompt and sampled tokens alike: every token's logprob, equal to
    transformers' log-softmax over the whole vocabulary, in the order of their ranks."""
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
    out = LLM(str(tiny_llama), max_logprobs=-1).generate([prompt], params, use_tqdm=False)[0]
    sampled = out.outputs[0]
    tokens = prompt + sampled.token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([tokens[:-1]])).logits[0].float().log_softmax(-1)
    entries = out.prompt_logprobs[1:] + sampled.logprobs
    assert len(entries) == len(tokens) - 1
    vocab = want.shape[-1]
    for token, row, entry in zip(tokens[1:], want, entries, strict=True):
        assert next(iter(entry)) == token and sorted(entry) == list(range(vocab))
        got = torch.tensor([entry[t].logprob for t in range(vocab)], dtype=torch.float64)
        torch.testing.assert_close(got, row.double(), rtol=1e-4, atol=1e-4)
        by_rank = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in by_rank] == list(range(1, vocab + 1))
        assert [lp.logprob for lp in by_rank] == sorted((lp.logprob for lp in by_rank), reverse=True)
