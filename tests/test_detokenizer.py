"""Incremental detokenization: multi-byte characters split over tokens, stop strings over
token boundaries, and streamed deltas that never show a stop string; the text decoded
once at the end (a reader that wants it only then) equal to the streamed text."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from services.tokenizer.tokenizer import Tokenizer
from shared.processing.detokenizer import IncrementalDetokenizer
from tiny_models import CORPUS, SPECIAL_TOKENS

TEXT = "héllo wörld — 東京 🙂 naïve café"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer(tiny_llama)


def stream(detok, token_ids):
    deltas = []
    for token_id in token_ids:
        detok.update([token_id])
        deltas.append(detok.get_delta(finished=detok.stop_string is not None))
    detok.flush()
    deltas.append(detok.get_delta(finished=True))
    return deltas


def test_multibyte_characters_split_across_tokens_decode_exactly(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The tiny BPE splits CJK and emoji into byte tokens: the case that matters.
    assert len(ids) > len(TEXT.split())
    detok = IncrementalDetokenizer(tokenizer.backend, [1, 2], stop=None)
    deltas = stream(detok, ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_is_found_and_cut(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend, [], stop=["wörld — 東"])
    deltas = stream(detok, ids)
    assert detok.stop_string == "wörld — 東"
    assert detok.output_text == "héllo "
    assert "".join(deltas) == "héllo "


def test_streamed_deltas_hold_back_a_possible_stop_prefix(tokenizer):
    ids = tokenizer.encode("abc abd abe", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend, [], stop=["abx"])
    sent = ""
    for token_id in ids:
        detok.update([token_id])
        sent += detok.get_delta(finished=False)
        # Never more than len(stop) - 1 characters are withheld.
        assert len(detok.output_text) - len(sent) <= 2
    sent += detok.get_delta(finished=True)
    assert sent == "abc abd abe"
    assert detok.stop_string is None


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend, [], stop=["three", "two"])
    detok.update(ids)
    assert detok.stop_string == "two"
    assert detok.output_text == "one "


def test_incomplete_bytes_at_the_end_become_replacement_characters(tokenizer):
    ids = tokenizer.encode("東", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer.backend, [], stop=None)
    detok.update(ids[:-1])
    assert detok.output_text == ""
    detok.flush()
    assert detok.output_text and set(detok.output_text) == {"\ufffd"}


def test_the_first_text_does_not_repeat_a_character_the_context_cuts():
    """The prompt's last 4 tokens may begin inside a character (with byte fallback, a CJK
    character the vocabulary lacks is 3 byte tokens): their text starts with U+FFFD, which
    the stream gave out before the output's own text (Llama-2's, Mistral's and Phi-3's
    kind of tokenizer)."""
    backend = sentencepiece_like()
    prompt = backend.encode("今天").ids
    assert backend.decode(prompt[-4:]).startswith("\ufffd")  # the case this is about
    assert "\ufffd" not in backend.decode(prompt)
    for incremental in (True, False):
        detok = IncrementalDetokenizer(backend, prompt, stop=None, incremental=incremental)
        detok.update(backend.encode("ok").ids)
        detok.flush()
        assert detok.output_text == " ok"


def sentencepiece_like() -> Backend:
    """Llama-2's and Mistral's kind: "▁" for spaces, byte tokens for what the vocabulary
    lacks, the first space stripped — whose text depends on where a decode starts."""
    import json

    trained = Backend(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}  # ordinary tokens, as in Llama-2
    for piece in learned["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    backend.add_special_tokens(SPECIAL_TOKENS)
    return backend


class Backends(dict):
    def __repr__(self) -> str:  # (hypothesis prints its arguments: names, not vocabularies)
        return f"Backends({sorted(self)})"


@pytest.fixture(scope="module")
def backends(tokenizer, smollm2):
    return Backends({"tiny byte-level BPE": tokenizer.backend, "SmolLM2": Tokenizer(smollm2).backend,
                     "sentencepiece-like": sentencepiece_like()})


def text_of(backend, prompt, out, skip, incremental) -> str:
    detok = IncrementalDetokenizer(backend, prompt, skip, stop=None, incremental=incremental)
    for token_id in out:  # as outputs arrive: one token each
        detok.update([token_id])
    detok.flush()
    return detok.output_text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_text_decoded_at_the_end_equals_the_streamed_text(backends, data, skip):
    """Whatever the tokens — byte tokens that split characters, across the prompt's end
    too, special ones, incomplete bytes at the end — in each tokenizer kind we load."""
    name = data.draw(st.sampled_from(sorted(backends)))
    backend = backends[name]
    size = backend.get_vocab_size()
    ids = st.integers(0, size - 1)
    prompt = data.draw(st.lists(ids, min_size=0, max_size=12))
    out = data.draw(st.lists(ids, min_size=0, max_size=24))
    assert text_of(backend, prompt, out, skip, False) == text_of(backend, prompt, out, skip, True), name


def test_text_at_the_end_comes_whole_with_the_finish_only(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend, [1, 2], stop=None, incremental=False)
    detok.update(ids)
    assert (detok.output_text, detok.get_delta(finished=False)) == ("", "")
    detok.flush()
    assert detok.get_delta(finished=True) == TEXT
    detok.flush()  # (twice: nothing changes)
    assert detok.output_text == TEXT


def test_stop_strings_keep_the_text_incremental(tokenizer):
    detok = IncrementalDetokenizer(tokenizer.backend, [], stop=["wörld"], incremental=False)
    assert detok.incremental
    assert detok.update(tokenizer.encode(TEXT, add_special_tokens=False)) == "wörld"
    assert detok.output_text == "héllo "


def test_a_byte_that_forms_no_character_does_not_fail_the_stream():
    """Byte fallback decodes a run of byte tokens that is not UTF-8 as one U+FFFD a byte,
    the valid ones before it included: the text already given out stopped being a prefix
    and tokenizers' stream raised (a Llama-2-kind model sampling bytes at a high
    temperature failed its request, and offline the whole batch)."""
    backend = sentencepiece_like()
    byte = backend.token_to_id
    out = [byte("<0x03>"), byte("<0x83>"), backend.token_to_id("<unk>"), *backend.encode("ok").ids]
    detok = IncrementalDetokenizer(backend, [], stop=None)
    for token_id in out:
        detok.update([token_id])
    detok.flush()
    assert detok.output_text.startswith("\x03") and detok.output_text.endswith("ok")
