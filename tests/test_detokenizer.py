"""Incremental detokenization: multi-byte characters split over tokens, stop strings over
token boundaries, and streamed deltas that never show a stop string."""

import pytest

from services.tokenizer.tokenizer import Tokenizer
from shared.detokenizer import IncrementalDetokenizer

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
