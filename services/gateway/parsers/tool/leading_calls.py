"""Llama's own formats: an answer that is text, or calls from its first character (Llama 3's JSON, Llama 3.2's and 4's Python list)."""

from __future__ import annotations

import json

from services.gateway.parsers.tool.base import ParsedDelta, ToolCallDelta, balanced_end, call_of, new_call_id


class _LeadingCallsParser:
    """Models whose answer is either text or, from its first character, calls alone (Llama
    3's JSON, Llama 3.2's and 4's Python list): the first character that is not space
    decides. Text streams as it comes; calls are read one whole unit at a time (`_units`)
    and announced as each completes. An answer that opened as calls but reads as none is
    content, whole; after a call, what does not read as one is dropped (as hermes' chatter)."""

    starts: tuple[str, ...] = ()  # what a calls answer opens with
    tags: tuple[str, ...] = ()  # special tokens a call may be wrapped in, when they are kept
    separators = " \t\n"  # what may come between units
    quotes = '"'  # the units' string quotes

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buffer = ""
        self.mode: str | None = None  # None (undecided), "content" or "calls"
        self.num_calls = 0
        self.read = 0  # in "calls": the buffer's units read up to here

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "content":
            out.content = text
            return out
        self.buffer += text
        if self.mode is None:
            head = self._untagged(self.buffer).lstrip()
            if not head or any(tag.startswith(head) for tag in self.tags):
                return out  # space, or the start of a tag: not yet decided
            if not head.startswith(self.starts):
                self.mode, out.content, self.buffer = "content", self.buffer, ""
                return out
            self.mode = "calls"
        self._calls(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "calls":
            self._calls(out, final=True)
        elif self.mode is None:
            out.content = self.buffer
        self.buffer = ""
        return out

    def _untagged(self, text: str) -> str:
        for tag in self.tags:
            text = text.replace(tag, "")
        return text

    def _calls(self, out: ParsedDelta, final: bool) -> None:
        text = self._untagged(self.buffer)
        for unit_calls, end in self._units(text, self.read, final):
            if unit_calls is None:  # not a call
                if self.num_calls == 0:  # the whole answer is content after all
                    self.mode, out.content, self.buffer = "content", self.buffer, ""
                    return
                self.read = len(text)
                break
            self.read = end
            for name, arguments in unit_calls:
                if self.max_calls is not None and self.num_calls >= self.max_calls:
                    break
                out.tool_calls += [ToolCallDelta(self.num_calls, new_call_id(), name),
                                   ToolCallDelta(self.num_calls, None, None, arguments)]
                self.num_calls += 1
        if final and self.num_calls == 0 and self.mode == "calls":
            out.content += self.buffer  # opened as calls, never finished one: its text

    def _units(self, text: str, start: int, final: bool):
        """Yields (the unit's calls as (name, JSON arguments), or None when it is no call;
        where it ends) for each complete unit of `text` from `start`: a bracketed value
        opening with one of `starts`."""
        pos = start
        while True:
            while pos < len(text) and text[pos] in self.separators:
                pos += 1
            if pos >= len(text):
                return
            if not text.startswith(self.starts, pos):
                yield None, len(text)
                return
            end = balanced_end(text, pos, self.quotes)
            if end is None:
                if final:
                    yield None, len(text)
                return
            yield self._read(text[pos:end]), end
            pos = end

    def _read(self, unit: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


class Llama3JsonToolParser(_LeadingCallsParser):
    """vLLM's `llama3_json`: Llama 3.1-3.3 answer a call as `{"name": ..., "parameters":
    {...}}` (after `<|python_tag|>` where special tokens are kept), several separated by `;`."""

    starts = ("{",)
    tags = ("<|python_tag|>",)
    separators = " \t\n;"

    def _read(self, unit: str) -> list[tuple[str, str]] | None:
        call = call_of(unit)
        return None if call is None else [call]


class PythonicToolParser(_LeadingCallsParser):
    """vLLM's `pythonic`: Llama 3.2's and 4's calls as a Python list of calls with keyword
    arguments, `[get_weather(city="Paris", days=2), get_time()]` (inside
    `<|python_start|>...<|python_end|>` where special tokens are kept); each argument a
    literal, sent as JSON."""

    starts = ("[",)
    tags = ("<|python_start|>", "<|python_end|>")
    quotes = "\"'"

    def _read(self, unit: str) -> list[tuple[str, str]] | None:
        return _python_calls(unit)


def _python_calls(source: str) -> list[tuple[str, str]] | None:
    import ast

    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError):
            return None  # (not a literal; or one JSON cannot hold: a set, bytes)
    return calls
