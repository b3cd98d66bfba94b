"""vLLM's synthetic rejection sampling, the benchmarking knob that pins the acceptance
length: drafts are accepted by chance at the set rates, not checked. With the target as
its own draft the text is still the model's (every draft is what it would sample) while
the acceptance follows the setting; with another draft the text is not the model's at
rate 1, and no draft is accepted at length 1, a request drafting to its end all the same."""

from __future__ import annotations

import pytest

from llmbus import LLM, SamplingParams
from services.worker.sample.synthetic_acceptance import rates_for_length
from shared.config import SpeculativeConfig
from tiny_models import build_tiny_model, hf_greedy

TEXTS = ["the cat sat on the mat, the cat sat on the mat, the cat", "1 2 3 4 5 1 2 3 4 5 1 2 3",
         "abc abc abc abc", "Paged attention keeps", "A gateway turns token ids", "Every worker holds"]
MAX_TOKENS = 60


def synthetic(draft, k: int = 3, **setting) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "rejection_sample_method": "synthetic", **setting}


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llama)
    return [tokenizer.encode(text) for text in TEXTS]


def run(model, prompts, config):
    llm = LLM(str(model), speculative_config=config)
    outputs = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    return outputs, llm.stats()


def test_a_length_is_a_constant_rate_whose_expected_acceptance_is_that_length():
    for k, length in ((3, 2.5), (4, 1.2), (1, 1.9), (3, 4.0), (3, 1.0)):
        p = rates_for_length(length, k)
        assert len(p) == k and len(set(p)) == 1
        assert 1 + sum(p[0] ** j for j in range(1, k + 1)) == pytest.approx(length, abs=1e-9)


def test_the_acceptance_length_follows_the_setting_and_the_self_drafted_text_is_the_models(tiny_llama, prompts):
    outputs, stats = run(tiny_llama, prompts, synthetic(tiny_llama, synthetic_acceptance_length=2.5))
    assert outputs == hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    # Each drafting step: 3 drafts, each accepted with p = 0.5437 given the ones before
    # (mean 1.5 accepted); ~80 steps: the mean is within 0.4 of 1.5 far beyond 3 sigma.
    assert stats.spec_decode_num_drafts > 50
    mean = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts
    assert 1.1 < mean < 1.9, mean


def test_rate_one_accepts_every_draft_and_length_one_none(tiny_llama, prompts, tmp_path):
    other = build_tiny_model(tmp_path / "other", "llama", seed=7)  # (its drafts mostly wrong)
    outputs, stats = run(tiny_llama, prompts, synthetic(other, synthetic_acceptance_rates=[1.0, 1.0, 1.0]))
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert outputs != hf_greedy(tiny_llama, prompts, MAX_TOKENS)  # (forced drafts: not the model's text)
    _, stats = run(tiny_llama, prompts, synthetic(tiny_llama, synthetic_acceptance_length=1.0))
    assert stats.spec_decode_num_accepted_tokens == 0
    # Every step drafts to the end (no probation: the rates are set, not earned): 3 drafts
    # a token but for the last few, where max_tokens leaves fewer slots
    assert stats.spec_decode_num_draft_tokens > len(prompts) * 3 * (MAX_TOKENS - 4)


@pytest.mark.parametrize("setting, why", [
    ({"rejection_sample_method": "synthetic"}, "takes one of synthetic_acceptance_length"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 5.0},
     r"must be in \[1, 4\] \(num_speculative_tokens \+ 1\), got 5.0"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5, 0.5]}, "must be 3 rates"),
    ({"synthetic_acceptance_length": 2.0}, 'take rejection_sample_method "synthetic"'),
    ({"rejection_sample_method": "typical"}, "must be strict or synthetic"),
])
def test_a_synthetic_setting_that_cannot_be_is_refused_by_name(setting, why):
    with pytest.raises(ValueError, match=why):
        SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3, **setting})
