"""Tool calls read out of generated text as it streams: what the model wrote as content,
and what it wrote as calls, each call's id and name first, then its arguments in fragments.

One parser per choice, fed the choice's text deltas. The non-streamed answer feeds its
whole text at once and assembles the same deltas, so both answers agree by construction.

- `HermesToolParser` (`--tool-call-parser hermes`, for `tool_choice: auto`): the model
  chose; calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (the format `services/tokenizer/tool_prompt.py` teaches), content is the text before
  the first. A block that is not a call is content.
- `RequiredToolParser` (`required`): a grammar made the text a JSON array of
  `{"name": ..., "arguments": {...}}` objects, separators fixed, name first; arguments
  stream as the model writes them.
- `NamedToolParser` (a named function): a grammar made the whole text its arguments.
"""

from __future__ import annotations

import json
import re
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


OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # 1 when the client asked for no parallel calls
        self.buffer = ""
        self.in_call = False
        self.space = ""  # the whitespace before the open block: dropped if it is a call
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while True:
            if self.in_call:
                at = self.buffer.find(CLOSE)
                if at < 0:
                    return out
                body, self.buffer = self.buffer[:at], self.buffer[at + len(CLOSE):]
                self.in_call = False
                self._call(body, OPEN + body + CLOSE, out)
                continue
            at = self.buffer.find(OPEN)
            if at >= 0:
                before = self.buffer[:at]
                self._content(before.rstrip(), out)
                self.space = before[len(before.rstrip()):]
                self.buffer, self.in_call = self.buffer[at + len(OPEN):], True
                continue
            # Held back: what may begin a tag, and trailing whitespace (dropped if a call
            # follows it, sent once other text does).
            head = self.buffer[:len(self.buffer) - _partial_suffix(self.buffer, OPEN)].rstrip()
            self._content(head, out)
            self.buffer = self.buffer[len(head):]
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_call:  # a call the model did not close, as small models often end
            self._call(self.buffer, OPEN + self.buffer, out)
        else:
            self._content(self.buffer, out)
        self.buffer, self.in_call = "", False
        return out

    def _content(self, text: str, out: ParsedDelta) -> None:
        # Text after the first call is not the message's content (the model's chatter
        # between calls); vLLM's hermes parser drops it too.
        if self.num_calls == 0:
            out.content += text

    def _call(self, body: str, raw: str, out: ParsedDelta) -> None:
        call, space, self.space = _call_of(body), self.space, ""
        if call is None:
            self._content(space + raw, out)
            return
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return  # a call beyond those asked for is neither a call nor content
        name, arguments = call
        out.tool_calls += [ToolCallDelta(self.num_calls, new_call_id(), name), ToolCallDelta(self.num_calls, None,
                                                                                             None, arguments)]
        self.num_calls += 1


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_of(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


# The head of one call in the grammar's array: separators fixed, name first; function
# names are OpenAI's [A-Za-z0-9_-], so no escapes inside it.
_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ')


class RequiredToolParser:
    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = self.escaped = False
        self.call_start: int | None = None  # where the call object being read began
        self.args_from: int | None = None  # arguments sent up to here; None outside them
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        out = ParsedDelta()
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.call_start = self.pos - 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 2 and self.args_from is not None:  # the arguments object closed
                    self._arguments(out)
                    self.args_from = None
            elif ch == " " and self.call_start is not None and self.depth == 2 and self.args_from is None:
                head = _HEAD.fullmatch(self.text, self.call_start, self.pos)
                if head:
                    out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), head.group(1)))
                    self.num_calls += 1
                    self.call_start, self.args_from = None, self.pos
        if self.args_from is not None:
            self._arguments(out)
        return out

    def _arguments(self, out: ParsedDelta) -> None:
        if self.pos > self.args_from:
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=self.text[self.args_from:self.pos]))
            self.args_from = self.pos

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


class NamedToolParser:
    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = self._start()
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ParsedDelta:
        return self._start()

    def _start(self) -> ParsedDelta:
        if self.num_calls:
            return ParsedDelta()
        self.num_calls = 1
        return ParsedDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self.name)])


# `--tool-call-parser`: how `tool_choice: auto` reads what the model wrote (vLLM's names).
TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesToolParser}
