"""Sampling parameters: one struct that travels from the API to the sampler.

It is a msgspec struct so it goes on the wire as it is; `__post_init__` validates,
so a bad value fails where it is built (offline `SamplingParams(...)`, or decoding a
message) with a `ValueError` that names the parameter.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec

# Below this a temperature means greedy; dividing logits by it would overflow.
GREEDY_EPSILON = 1e-5


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One constraint on the output (vLLM's `structured_outputs`): exactly one field set.
    The spec travels with the request; the worker compiles it and masks the logits."""

    json: str | dict[str, Any] | None = None  # a JSON schema (kept as JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF), xgrammar's dialect

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, dict):
            self.json = msgspec.json.encode(self.json).decode()
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what a request's outputs carry. CUMULATIVE and DELTA: the engine hands its
    tokens over as each step lands them; FINAL_ONLY: once, all of them, when it finishes
    (LLM.generate asks so)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = []
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended it stays in the text
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    # Each prompt token's logprob (but the first's) and this many top alternatives, as
    # vLLM's: the whole prompt is computed for it (no prefix cache hits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before sampling (greedy too): -100 bans a
    # token, +100 all but forces it (OpenAI's logit_bias).
    logit_bias: dict[int, float] = {}
    # vLLM's: sample only among these token ids (the rest masked, greedy too).
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output must not contain. A word's last token is masked wherever
    # the output's last tokens are the ones before it (its first, from the start), with
    # and without a leading space. `bad_words_token_ids` are the words' token ids, set from
    # `bad_words` by `with_bad_words_tokenized` where the tokenizer is (gateway, LLM); the
    # sampler reads only them.
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # An embedding request (vLLM's embed task; `embedding_params()`): the model's final
    # hidden state at the prompt's last token, L2-normalized, comes back with one
    # placeholder token, nothing sampled.
    embed: bool = False
    # vLLM's. FINAL_ONLY spares every step the landing of a request's tokens (at batch 128
    # a share of the host's work a step; docs/performance/history.md); stop strings are looked for
    # in the text as it grows, so a request with them gets its tokens step by step anyway.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):  # (offline, as a served request's field reads)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        # -1: the whole vocabulary (vLLM's). How many the engine gives is its --max-logprobs,
        # which the scheduler checks (Scheduler.add_request).
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be -1 (the whole vocabulary) or non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(f"prompt_logprobs must be -1 (the whole vocabulary) or non-negative, "
                             f"got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.min_tokens and self.structured_outputs is not None:
            # Banning the stop token past the grammar's end would force tokens it forbids.
            raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides where "
                             "the output ends")
        if self.embed and (self.max_tokens != 1 or self.n != 1):
            raise ValueError("an embedding request samples one token, once: max_tokens 1 and n 1")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or min(self.allowed_token_ids) < 0):
            raise ValueError("allowed_token_ids must be a non-empty list of non-negative token ids")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps non-negative token ids to biases in [-100, 100]")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must not contain empty (or blank) words")
        if self.bad_words_token_ids is not None and any(not w or min(w) < 0 for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def argmax_only(self) -> bool:
        """Whether its every token is the argmax of the model's logits as they are: greedy,
        nothing that changes or reads the distribution (penalties, bias, allowed ids,
        min_tokens' ban, bad words, a grammar, logprobs), no embedding."""
        return (self.greedy and not self.needs_penalties and not self.logit_bias and self.allowed_token_ids is None
                and not self.min_tokens and not self.bad_words_token_ids and self.structured_outputs is None
                and self.logprobs is None and self.prompt_logprobs is None and not self.embed)

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling reads output tokens before the latest one: penalties count them,
        a bad word of several tokens compares them."""
        return self.needs_penalties or any(len(w) > 1 for w in self.bad_words_token_ids or ())


def with_bad_words_tokenized(params: SamplingParams, encode: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with its bad words' token ids (vLLM's rule): each word as written with its
    leading space stripped, and with one space before it where that is a word of its own
    (another first token, as many tokens: "Paris" and " Paris" in a BPE vocabulary, not
    a SentencePiece one's extra "▁"). `encode`: text to ids, no special tokens added."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    token_ids: list[list[int]] = []
    for word in params.bad_words:
        bare = encode(word.lstrip())
        if not bare:  # (a tokenizer whose normalizer drops every character of it)
            raise ValueError(f"bad_words: {word!r} is no tokens to this tokenizer")
        spaced = encode(" " + word.lstrip())
        token_ids.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            token_ids.append(spaced)
    return msgspec.structs.replace(params, bad_words_token_ids=token_ids)


def embedding_params() -> SamplingParams:
    """An embedding request's params: its prompt computed, one token after it."""
    return SamplingParams(max_tokens=1, temperature=0.0, embed=True)
