"""Prompts as vLLM's `LLM` takes them: a string, token ids, or a dict that says which and
carries per-prompt options (vLLM's `TextPrompt` and `TokensPrompt`).

`{"prompt_token_ids": ids}` is how vLLM's users hand over pre-tokenized prompts;
`cache_salt` keeps a prompt's prefix-cache hits to prompts with the same salt;
`multi_modal_data` gives a text prompt's images (`{"image": a PIL image or a list}`), each
marked in the text by the model's placeholder. A key llmbus does not implement is refused
by name, not dropped.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


Prompt = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    text: str | None  # None: given as token ids
    token_ids: list[int] | None  # None: to be encoded from `text`
    cache_salt: str | None = None
    images: tuple = ()  # PIL images, in the order the text marks them


def is_one_prompt(prompts) -> bool:
    """Whether `generate`'s argument is one prompt rather than a list of them."""
    return isinstance(prompts, (str, dict)) or bool(prompts) and isinstance(prompts[0], int)


def parse_prompt(prompt: Prompt) -> ParsedPrompt:
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"})
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
            return ParsedPrompt(prompt["prompt"], None, salt, _images(prompt.get("multi_modal_data")))
        if prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data needs the prompt's text ('prompt'), where its images are marked, "
                             "not 'prompt_token_ids'")
        return ParsedPrompt(None, _token_ids(prompt["prompt_token_ids"]), salt)
    return ParsedPrompt(None, _token_ids(prompt))


def _token_ids(ids) -> list[int]:
    """A list of ints (numpy's integers too, as vLLM users often hold them)."""
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise TypeError("prompt token ids must be integers") from None


def _images(data) -> tuple:
    """`multi_modal_data`'s images (vLLM's shape: one image or a list under "image")."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise TypeError("multi_modal_data must be a dict such as {'image': image}")
    other = sorted(set(data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data modality {other[0]!r} is not supported by llmbus (images only)")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    from PIL import Image  # (only where images are given)

    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"multi_modal_data['image'][{i}] must be a PIL image, got {type(image).__name__}")
    return tuple(images)
