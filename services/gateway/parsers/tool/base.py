"""What every tool-call parser emits (content and call deltas), what it is (ToolCallParser), and the readers several formats share: a call from a JSON object, the end of a bracketed value."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # which of the choice's calls
    id: str | None = None  # id and name come once, on a call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def one_per_call(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """A chunk's call deltas, one per call index in the order they began (OpenAI's and vLLM's
    streams): a parser's several events for a call in one step (its name, then the first of
    its arguments) merged, or a client that reads one entry per index loses the rest."""
    if len(calls) < 2:
        return calls
    merged: dict[int, ToolCallDelta] = {}
    for call in calls:
        into = merged.get(call.index)
        if into is None:
            merged[call.index] = ToolCallDelta(call.index, call.id, call.name, call.arguments)
        else:
            into.id, into.name = into.id or call.id, into.name or call.name
            into.arguments += call.arguments
    return list(merged.values())


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolCallParser(Protocol):
    num_calls: int

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole text's content and calls: the stream's deltas, assembled."""
    parsed = parser.feed(text).add(parser.finish())
    calls: list[ToolCall] = []
    for d in parsed.tool_calls:
        if d.id is not None:
            calls.append(ToolCall(d.id, d.name or "", ""))
        calls[d.index].arguments += d.arguments
    return parsed.content, calls


def call_of(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call_from(value)


def call_from(value) -> tuple[str, str] | None:
    """(name, JSON arguments) of a decoded `{"name": ..., "arguments" (or "parameters"): ...}`."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


# The head of one call in the grammar's array: separators fixed, name first; function
# names are OpenAI's [A-Za-z0-9_-], so no escapes inside it.


def balanced_end(text: str, start: int, quotes: str) -> int | None:
    """Where the bracketed value opening at `start` closes (one past it), strings in
    `quotes` skipped with their escapes; None while it is open."""
    depth, quote, escaped = 0, None, False
    for i in range(start, len(text)):
        ch = text[i]
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in quotes:
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
