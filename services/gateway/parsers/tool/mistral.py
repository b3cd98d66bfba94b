"""Mistral's calls after `[TOOL_CALLS]` (both of its formats), and Granite 3's after `<|tool_call|>`."""

from __future__ import annotations

import json

from services.gateway.parsers.streamed import partial_suffix
from services.gateway.parsers.tool.base import ParsedDelta, ToolCallDelta, balanced_end, call_from, new_call_id

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser:
    """vLLM's `mistral`: content, then `[TOOL_CALLS]` (a special token: these requests keep
    them in their text, `keeps_special_tokens`) and the calls, as a JSON array of `{"name",
    "arguments"}` objects (Mistral 7B v0.3, Small 3.1), or `name[ARGS]{...}` after each tag
    (the newer tokenizers': Small 3.2, Magistral). Each call is announced once whole."""

    keeps_special_tokens = True
    tag = TOOL_CALLS  # what opens the calls

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buffer = ""
        self.in_calls = False
        self.num_calls = 0
        self.raw = ""  # the text from the tag on, until a call reads: content if none does
        self.as_content = False  # the tag led to no call: the rest is content as written

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.as_content:
            out.content = text
            return out
        self.buffer += text
        if self.in_calls and not self.num_calls:
            self.raw += text
        if not self.in_calls:
            at = self.buffer.find(self.tag)
            if at < 0:  # (held back: what may begin the tag, and the space before it)
                sent = self.buffer[:len(self.buffer) - partial_suffix(self.buffer, self.tag)].rstrip()
                out.content, self.buffer = sent, self.buffer[len(sent):]
                return out
            before = self.buffer[:at]
            out.content, self.raw = before.rstrip(), before[len(before.rstrip()):] + self.buffer[at:]
            self.buffer, self.in_calls = self.buffer[at + len(self.tag):], True
        self._calls(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_calls:
            self._calls(out, final=True)
        else:
            out.content = self.buffer
        self.buffer = ""
        return out

    def _calls(self, out: ParsedDelta, final: bool) -> None:
        while (read := self._next(self.buffer.lstrip())) is not None:
            calls, self.buffer = read
            for call in calls:
                if call is None:
                    if not self.num_calls:  # no call after the tag: it and all after it are content
                        out.content, self.as_content = out.content + self.raw, True
                    self.buffer = ""  # (after a call: dropped, as hermes' chatter)
                    return
                if self.max_calls is None or self.num_calls < self.max_calls:
                    out.tool_calls += [ToolCallDelta(self.num_calls, new_call_id(), call[0]),
                                       ToolCallDelta(self.num_calls, None, None, call[1])]
                    self.num_calls += 1
        if final:
            if not self.num_calls and not self.as_content:  # no call after the tag (none at all, or
                out.content += self.raw  # cut short): the tag and its text are content, as vLLM's
            self.buffer = ""

    def _next(self, text: str) -> tuple[list, str] | None:
        """(the calls at the start of `text`, None for one that is not a call; the text
        after them), or None until they are whole."""
        if text.startswith(self.tag):  # (the newer format tags each call)
            text = text[len(self.tag):].lstrip()
        if text.startswith("["):  # a JSON array of calls
            if (read := _leading_json(text)) is None:
                return None
            items, end = read
            return ([call_from(item) for item in items] if isinstance(items, list) else [None]), text[end:]
        name, _, rest = text.partition(ARGS)  # name[ARGS]{...}
        body = rest.lstrip()
        if not body or (read := _leading_json(body)) is None:
            return None
        arguments, end = read
        call = call_from({"name": name.strip(), "arguments": arguments}) if name.strip() and arguments is not _NOT_JSON \
            else None
        return [call], body[end:]


_NOT_JSON = object()


def _leading_json(text: str) -> tuple[object, int] | None:
    """(the JSON value an object or array at the start of `text` decodes to, _NOT_JSON if
    none; where it ends), or None while it is open. Any other text is read whole."""
    end = balanced_end(text, 0, '"') if text.startswith(("{", "[")) else len(text)
    if end is None:
        return None
    try:
        return json.loads(text[:end]), end
    except json.JSONDecodeError:
        return _NOT_JSON, end


class GraniteToolParser(MistralToolParser):
    """vLLM's `granite`: Granite 3's `<|tool_call|>` (a special token) and a JSON array of
    `{"name", "arguments"}` calls, content before it, read as mistral's first format."""

    tag = "<|tool_call|>"
