"""gpt-oss's calls: harmony messages to `functions.NAME` (parsers/harmony.py reads the messages)."""

from __future__ import annotations

from services.gateway.parsers.harmony import HarmonyStream
from services.gateway.parsers.tool.base import ParsedDelta, ToolCallDelta, new_call_id


class HarmonyToolParser:
    """vLLM's `openai`: gpt-oss's harmony messages to `functions.NAME` are calls, their
    bodies the arguments (harmony.py reads the messages); other messages' text is content."""

    keeps_special_tokens = True  # (its markers are special tokens: the text keeps them)

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.stream = HarmonyStream()
        self.num_calls = 0
        self.calling = False  # the open message is a call (its text: the arguments)
        self.dropping = False  # a call beyond max_calls: neither a call nor content

    def feed(self, text: str) -> ParsedDelta:
        return self._read(self.stream.feed(text))

    def finish(self) -> ParsedDelta:
        return self._read(self.stream.finish())

    def _read(self, events: list[tuple]) -> ParsedDelta:
        out = ParsedDelta()
        for event in events:
            if event[0] == "open":
                recipient = event[2]
                self.calling = recipient is not None
                if self.calling and self.max_calls is not None and self.num_calls >= self.max_calls:
                    self.calling, self.dropping = False, True
                elif self.calling:
                    name = recipient.removeprefix("functions.")
                    out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), name))
                    self.num_calls += 1
            elif event[0] == "text":
                if self.calling:
                    out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=event[1]))
                elif not self.dropping:
                    out.content += event[1]
            else:
                self.calling = self.dropping = False
        return out
