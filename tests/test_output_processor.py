"""The output processor that `LLM` and the gateway share: n fan-out with seeds, text as
tokens arrive, a stop string that ends a choice here (and asks for the engine's abort),
and outputs that come after a choice is over."""

import pytest

from services.tokenizer.tokenizer import Tokenizer
from shared.messages import EngineCoreOutput, FinishReason, Logprobs
from shared.processing.output_processor import ParentRequest
from shared.sampling_params import SamplingParams

TEXT = "héllo wörld — 東京 🙂 naïve café"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer(tiny_llama)


def parent(tokenizer, incremental: bool = True, **params) -> ParentRequest:
    return ParentRequest("cmpl-1", [1, 2, 3], SamplingParams(**params), tokenizer.backend, eos_token_id=0,
                         reply_subject="out.g1", trace_headers={"traceparent": "x"}, incremental=incremental)


def test_n_choices_are_n_engine_requests_seeded_apart(tokenizer):
    p = parent(tokenizer, n=3, seed=5)
    assert p.child_ids == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
    assert [r.sampling_params.seed for r in p.engine_requests] == [5, 6, 7]
    assert {r.reply_subject for r in p.engine_requests} == {"out.g1"}
    assert all(r.prompt_token_ids == [1, 2, 3] and r.eos_token_id == 0 for r in p.engine_requests)


def test_one_choice_keeps_its_seed(tokenizer):
    assert [r.sampling_params.seed for r in parent(tokenizer, seed=5).engine_requests] == [5]


def test_text_grows_with_the_tokens_and_ends_with_the_finish(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    p = parent(tokenizer, max_tokens=len(ids))
    lp = Logprobs([ids[0]], [-0.5], 1)
    deltas = [p.apply(EngineCoreOutput("cmpl-1-0", [t], new_logprobs=[lp], num_cached_tokens=2)) for t in ids[:-1]]
    deltas.append(p.apply(EngineCoreOutput("cmpl-1-0", [ids[-1]], FinishReason.LENGTH)))
    assert "".join(d.text for d in deltas) == TEXT
    assert [t for d in deltas for t in d.token_ids] == ids
    assert deltas[0].logprobs == [lp] and deltas[0].num_cached_tokens == 2
    assert [d.finish_reason for d in deltas] == [None] * (len(ids) - 1) + [FinishReason.LENGTH]
    assert p.finished and p.unfinished_ids() == []
    assert not any(d.needs_abort for d in deltas)


def test_a_reader_of_whole_texts_gets_each_with_its_finish(tokenizer):
    """Not incremental (offline, or a response sent whole): every token as it comes, the
    text once, in the last delta — the same text."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    p = parent(tokenizer, incremental=False, n=2, seed=1)
    deltas = [p.apply(EngineCoreOutput("cmpl-1-1", [t])) for t in ids[:-1]]
    deltas.append(p.apply(EngineCoreOutput("cmpl-1-1", [ids[-1]], FinishReason.LENGTH)))
    assert [d.text for d in deltas] == [""] * (len(ids) - 1) + [TEXT]
    assert [t for d in deltas for t in d.token_ids] == ids and {d.index for d in deltas} == {1}
    assert p.unfinished_ids() == ["cmpl-1-0"]


@pytest.mark.parametrize("incremental", [True, False])
def test_a_stop_string_ends_the_choice_here_and_asks_for_the_abort(tokenizer, incremental):
    """Also for a reader of whole texts: stop strings are looked for as the text grows."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    p = parent(tokenizer, incremental, n=2, stop=["wörld"])
    deltas = []
    for t in ids:
        d = p.apply(EngineCoreOutput("cmpl-1-0", [t]))
        if d is None:
            break  # over: what was in flight is dropped
        deltas.append(d)
    last = deltas[-1]
    assert last.needs_abort and last.finish_reason == FinishReason.STOP and last.stop_reason == "wörld"
    assert "".join(d.text for d in deltas) == TEXT[: TEXT.index("wörld")]
    assert len(deltas) < len(ids)
    assert p.unfinished_ids() == ["cmpl-1-1"] and not p.finished


def test_outputs_of_unknown_or_finished_choices_are_ignored(tokenizer):
    p = parent(tokenizer)
    assert p.apply(EngineCoreOutput("cmpl-9-0", [5])) is None
    assert p.apply(EngineCoreOutput("cmpl-1-0", [5], FinishReason.STOP, stop_reason=5)).stop_reason == 5
    assert p.apply(EngineCoreOutput("cmpl-1-0", [6])) is None


def test_an_engine_error_arrives_as_the_choice_s_end(tokenizer):
    p = parent(tokenizer)
    d = p.apply(EngineCoreOutput("cmpl-1-0", [], FinishReason.ERROR, error="step failed"))
    assert (d.finish_reason, d.error, d.text) == (FinishReason.ERROR, "step failed", "")
    assert p.finished
