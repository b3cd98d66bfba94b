"""Beam search (vLLM's LLM.beam_search and `use_beam_search`): the engine's candidates each
step, kept and ranked as vLLM keeps them, equal to the same search run on transformers'
log-probabilities (written out here apart from shared/processing/beam_search.py, so a slip in either
shows)."""

from __future__ import annotations

import pytest
import torch

from llmbus import LLM, BeamSearchParams, SamplingParams, TokensPrompt
from tiny_models import random_prompts

PROMPTS = random_prompts([3, 9, 20], seed=11)


def hf_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: int, length_penalty: float = 1.0,
                   ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """vLLM's algorithm over transformers' logits: (tokens, cumulative logprob), best first."""
    def score(tokens, cum):
        length = len(tokens) - (1 if tokens[-1] == eos else 0)
        return cum / length ** length_penalty

    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = model(torch.tensor([tokens])).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(2 * width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
                if token == eos and not ignore_eos:
                    done.append((tokens, cum + logprob))
                else:
                    grown.append((tokens + [token], cum + logprob))
        live = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.mark.parametrize("width, length_penalty, eos", [(1, 1.0, None), (3, 1.0, None), (4, 0.5, "frequent")])
def test_beam_search_equals_the_same_search_on_transformers(tiny_llama, hf_model, width, length_penalty, eos):
    """Widths 1 (greedy) to 4, a length penalty, and an EOS that ends beams: each prompt's
    beams, their tokens and cumulative logprobs, in order."""
    llm = LLM(str(tiny_llama))
    eos_id = llm.eos_token_id
    if eos == "frequent":  # an EOS the random model often puts among its candidates
        with torch.no_grad():
            firsts = hf_model(torch.tensor([PROMPTS[1]])).logits[0, -1].topk(2).indices.tolist()
        eos_id = llm.eos_token_id = firsts[1]
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    out = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    for prompt, answer in zip(PROMPTS, out, strict=True):
        want = hf_beam_search(hf_model, prompt, width, 6, eos_id, length_penalty)
        assert [b.tokens for b in answer.sequences] == [tokens for tokens, _ in want]
        assert [b.cum_logprob for b in answer.sequences] == pytest.approx([cum for _, cum in want], abs=1e-4)
        assert all(b.text == llm.tokenizer.decode(b.tokens, skip_special_tokens=False) for b in answer.sequences)
        assert {b.finish_reason for b in answer.sequences} <= {"stop", "length"}
    if eos == "frequent":
        assert any(b.finish_reason == "stop" for answer in out for b in answer.sequences)


def test_width_one_is_greedy_and_a_beam_stops_at_the_context(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=24)
    greedy = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    beam = llm.beam_search([TokensPrompt(prompt_token_ids=PROMPTS[2])],
                           BeamSearchParams(beam_width=1, max_tokens=4, ignore_eos=True))[0].sequences[0]
    assert beam.tokens == PROMPTS[2] + greedy.outputs[0].token_ids
    long = llm.beam_search([TokensPrompt(prompt_token_ids=PROMPTS[2])],
                           BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))[0]
    assert {len(b.tokens) for b in long.sequences} == {24}  # the context, not 20 + 50
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
