"""OpenAI's response bodies as msgspec structs, and the logprobs in each endpoint's shape.

Fields that OpenAI sends as `null` are plain fields; `usage` on stream chunks is UNSET
(absent) unless the client asked for it, then null on every chunk but the last.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from shared.messages import Logprob, Logprobs


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails  # always: benchmark clients read cached_tokens

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                   PromptTokensDetails(cached_tokens))


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON string, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    type: str
    function: FunctionCall


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # null beside tool calls with no text before them
    tool_calls: list[ToolCall] = []  # absent when there are none
    reasoning: str | None = None  # vLLM's, with --reasoning-parser: the thinking (absent without)


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """One call's piece of a chunk: index, id, type and name first, then arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    prompt_logprobs: list[dict[str, Any] | None] | UnsetType = UNSET  # vLLM's, when asked for
    # vLLM's return_token_ids: the choice's prompt (streamed: with its first chunk) and its tokens
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class Response(msgspec.Struct):
    """A whole (non-streamed) response: `text_completion` or `chat.completion`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice] | list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | UnsetType = UNSET  # vLLM's, a chat's when asked for
    prompt_token_ids: list[int] | UnsetType = UNSET  # vLLM's return_token_ids, a chat's


class Chunk(msgspec.Struct):
    """One SSE event: `text_completion` or `chat.completion.chunk`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice] | list[ChatChunkChoice]
    usage: UsageInfo | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # a chat stream's first chunk, with return_token_ids


class LogprobsFormatter:
    """Token ids as text, in each endpoint's logprobs shape."""

    def __init__(self, tokenizer, as_token_ids: bool = False) -> None:  # a `tokenizers.Tokenizer`
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids  # vLLM's return_tokens_as_token_ids

    def _text(self, token_id: int) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, items: list[Logprobs], first_token: int | None = None,
                   offset: int = 0) -> tuple[dict[str, Any], int]:
        """`first_token`: an echoed prompt's first, which has no logprob (OpenAI's null);
        `items` then begin with the rest of the prompt's. `text_offset` indexes the choice's
        text: `offset` is the first token's, each next one starts where the one before
        ends, decoded alone (as vLLM's: approximate where a character spans tokens).
        Returns the logprobs and where a next token would start (a stream's next chunk)."""
        head, none = ([first_token], [None]) if first_token is not None else ([], [])
        ids = head + [lp.token_ids[0] for lp in items]
        ends = list(accumulate((len(self.tokenizer.decode([t], skip_special_tokens=False)) for t in ids),
                               initial=offset))
        return {
            "tokens": [self._text(t) for t in ids],
            "token_logprobs": none + [lp.logprobs[0] for lp in items],
            "top_logprobs": none + [
                {self._text(t): v for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])} for lp in items
            ],
            "text_offset": ends[:-1],
        }, ends[-1]


    def prompt(self, items: list[Logprobs]) -> list[dict[int, Logprob] | None]:
        """vLLM's prompt_logprobs: per prompt token (None for the first) the token's own and
        the top-k's, by token id, each with its rank and text."""
        return [None] + [lp.by_token(self._text) for lp in items]  # (msgspec writes the ids as keys)

    def chat(self, items: list[Logprobs]) -> dict[str, Any]:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = self._text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(lp.token_ids[0], lp.logprobs[0]),
                 "top_logprobs": [entry(t, v) for t, v in zip(lp.token_ids[1:], lp.logprobs[1:])]}
                for lp in items
            ]
        }
