"""Calls a grammar forced: `tool_choice: required` (a JSON array of calls) and a named function (the whole text its arguments)."""

from __future__ import annotations

import re

from services.gateway.parsers.tool.base import ParsedDelta, ToolCallDelta, new_call_id

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
