"""Prompts as vLLM's `LLM` takes them: a string, token ids, or a dict that says which and
carries per-prompt options (vLLM's `TextPrompt` and `TokensPrompt`).

`{"prompt_token_ids": ids}` is how vLLM's users hand over pre-tokenized prompts;
`cache_salt` keeps a prompt's prefix-cache hits to prompts with the same salt. A key
llmbus does not implement (`multi_modal_data`, …) is refused by name, not dropped.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


Prompt = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    text: str | None  # None: given as token ids
    token_ids: list[int] | None  # None: to be encoded from `text`
    cache_salt: str | None = None


def is_one_prompt(prompts) -> bool:
    """Whether `generate`'s argument is one prompt rather than a list of them."""
    return isinstance(prompts, (str, dict)) or bool(prompts) and isinstance(prompts[0], int)


def parse_prompt(prompt: Prompt) -> ParsedPrompt:
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
        if unknown:
            raise ValueError(f"prompt key {unknown[0]!r} is not supported by llmbus")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids'")
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt must be a non-empty string")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            return ParsedPrompt(prompt["prompt"], None, salt)
        return ParsedPrompt(None, _token_ids(prompt["prompt_token_ids"]), salt)
    return ParsedPrompt(None, _token_ids(prompt))


def _token_ids(ids) -> list[int]:
    """A list of ints (numpy's integers too, as vLLM users often hold them)."""
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise TypeError("prompt token ids must be integers") from None
