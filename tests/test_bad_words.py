"""vLLM's bad_words: the mask against vLLM's own rule applied to the whole output (a
request's latest token on the device or not, draft positions), greedy output against
transformers' bad_words_ids (steps in flight, speculation), and the words' tokenization."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus import LLM, SamplingParams
from services.worker.sample.bad_words import apply_bad_words
from services.worker.request_state import RequestState
from services.worker.sample.draft_position import DraftPosition
from shared.sampling_params import with_bad_words_tokenized
from test_launched_steps import overlapping, overlaps  # noqa: F401 (a fixture)
from tiny_models import hf_greedy

VOCAB = 5  # few ids, so the output often ends with a word's first tokens


def reference(logits: torch.Tensor, outputs: list[list[int]], words: list[list[list[int]]]) -> torch.Tensor:
    """vLLM's loop (v1/sample/ops/bad_words.py) over each row's whole output."""
    logits = logits.clone()
    for row, output, row_words in zip(logits, outputs, words):
        for word in row_words:
            if len(word) > len(output) + 1:
                continue
            before = len(word) - 1
            if output[len(output) - before:] == word[:-1] or not before:
                row[word[-1]] = float("-inf")
    return logits


rows = st.tuples(
    st.lists(st.integers(0, VOCAB - 1), max_size=6),  # output
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=4),  # its words
    st.sampled_from(["landed", "pending", "drafts"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(rows, min_size=1, max_size=5), st.integers(0, 2**31))
def test_the_mask_is_vllm_s_rule_on_the_whole_output(batch, seed):
    """A row whose latest token is still on the device (a step in flight) is masked as if
    it had landed; a draft position counts its drafts as output."""
    logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed))
    states, outputs = [], []
    for i, (output, words, where) in enumerate(batch):
        prompt = [1, 2]
        params = SamplingParams(bad_words_token_ids=words or None)
        landed = output[:-1] if where == "pending" and output else output
        s = RequestState(f"r{i}", prompt + landed, len(prompt), params, None, 0, len(prompt) + len(landed))
        if where == "pending" and output:
            s.num_pending, s.pending_token = 1, (torch.tensor([9, output[-1]]), 1)  # its row of a step's ids
        if where == "drafts" and output:
            s.token_ids, s = s.token_ids[:-1], None
            s = DraftPosition(RequestState(f"r{i}", prompt + output[:1], 2, params, None, 0, 3), output[1:])
        states.append(s)
        outputs.append(output)
    got = logits.clone()
    apply_bad_words(got, states)
    assert torch.equal(got, reference(logits, outputs, [w for _, w, _ in batch]))


def test_more_than_one_token_on_the_device_is_refused_not_guessed():
    s = RequestState("r", [1, 2, 3], 2, SamplingParams(bad_words_token_ids=[[3, 4]]), None, 0, 3)
    s.num_pending, s.pending_token = 2, (torch.tensor([3]), 0)
    with pytest.raises(RuntimeError, match="on the device"):
        apply_bad_words(torch.zeros(1, VOCAB), [s])


def test_words_are_tokenized_as_written_and_after_a_space(tiny_llama):
    """vLLM's rule: the word with its leading spaces stripped, and after one space where
    that is as many tokens with another first one (this byte-level BPE: "cat" and " cat";
    " mat" is one token more than "mat", so only "mat")."""
    from services.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llama)
    encode = lambda w: tokenizer.encode(w, add_special_tokens=False)  # noqa: E731
    assert len(encode(" cat")) == len(encode("cat")) and len(encode(" mat")) == len(encode("mat")) + 1
    params = with_bad_words_tokenized(SamplingParams(bad_words=["cat", "  mat"]), encode)
    assert params.bad_words_token_ids == [encode("cat"), encode(" cat"), encode("mat")]
    assert with_bad_words_tokenized(params, None) is params  # tokenized once
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["ok", " "])


def test_greedy_output_equals_transformers_bad_words_ids(tiny_llama, overlaps):
    """Words cut from the free output (one, two and three tokens, none begun by the
    prompt's end, where transformers would look and vLLM does not): the output avoids
    them exactly as transformers' does — each step finished at once, steps overlapped
    (the latest token compared on the device), and with speculation — beside an
    unconstrained request; a word id outside the vocabulary is a ValueError."""
    from test_spec_decode import SPEC

    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44], [9, 9, 9]]
    free = hf_greedy(tiny_llama, prompts, 24)
    words = [[free[0][2]], free[0][5:7], free[1][8:11]]
    assert all(w[0] not in (p[-1] for p in prompts) for w in words if len(w) > 1)
    expected = hf_greedy(tiny_llama, prompts[:2], 24, bad_words_ids=words)
    assert expected[0] != free[0] and expected[1] != free[1]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words_token_ids=words)] * 2
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for llm in (LLM(str(tiny_llama)), overlapping(tiny_llama), LLM(str(tiny_llama), speculative_config=SPEC)):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == [*expected, free[2]]
    assert overlaps["launched_behind"] >= 20  # (the overlapping one's steps)
    with pytest.raises(ValueError, match="bad_words token id"):
        llm.generate(prompts[0], SamplingParams(max_tokens=2, bad_words_token_ids=[[1, 10**6]]))
