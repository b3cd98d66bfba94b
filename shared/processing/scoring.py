"""How vLLM's score API pairs its texts, for /score and LLM.score alike: one text_1
against every text_2, or text_1[i] against text_2[i]. A pair's score from an embedding
model (a bi-encoder, as vLLM scores with one) is the cosine similarity of the two texts'
vectors: their dot product, the vectors being L2-normalized. From a cross-encoder (a
sequence classifier of one label) it is the classifier's output on the pair encoded
together, as its tokenizer encodes a text pair (`pair_token_ids`)."""

from __future__ import annotations

from collections.abc import Sequence


def score_pairs(text_1, text_2, limit: int) -> tuple[list, list[tuple[int, int]]]:
    """(the distinct texts to embed, each pair as indices into them). A text is a string or
    token ids; ValueError (naming text_1 or text_2) for what cannot be paired."""
    ones = [text_1] if _is_one(text_1) else list(text_1)
    twos = [text_2] if _is_one(text_2) else list(text_2)
    for field, texts in (("text_1", ones), ("text_2", twos)):
        if not texts or any(not t for t in texts):
            raise ValueError(f"{field} must be a non-empty text or a non-empty list of them")
    if len(ones) == 1:
        ones = ones * len(twos)
    elif len(ones) != len(twos):
        raise ValueError(f"text_1 has {len(ones)} texts and text_2 {len(twos)}: give one text_1, or one for each "
                         "text_2")
    distinct: dict = {}
    pairs = [(_index(distinct, a), _index(distinct, b)) for a, b in zip(ones, twos)]
    if len(distinct) > limit:
        raise ValueError(f"text_2 gives {len(distinct)} distinct texts to embed; the limit is {limit}")
    return [_text(key) for key in distinct], pairs


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Of two L2-normalized vectors (the engine's embeddings): their dot product."""
    return float(sum(x * y for x, y in zip(a, b)))


def _is_one(text) -> bool:
    return isinstance(text, str) or (isinstance(text, list) and bool(text) and isinstance(text[0], int))


def _index(distinct: dict, text) -> int:
    key = text if isinstance(text, str) else ("ids", tuple(text))
    return distinct.setdefault(key, len(distinct))


def _text(key):
    return key if isinstance(key, str) else list(key[1])


def pair_token_ids(hf_tokenizer, text_1, text_2) -> list[int]:
    """A cross-encoder's input: the pair as the tokenizer encodes a text pair (its template's
    special tokens around and between them), or token ids as given, one after the other."""
    if isinstance(text_1, str) and isinstance(text_2, str):
        return list(hf_tokenizer(text_1, text_2)["input_ids"])
    if isinstance(text_1, str) or isinstance(text_2, str):
        raise ValueError("text_1 and text_2 must both be texts or both token ids to be scored together")
    return [*text_1, *text_2]
