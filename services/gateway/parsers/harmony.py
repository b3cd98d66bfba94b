"""gpt-oss's harmony answers read as they stream: vLLM's `--reasoning-parser openai_gptoss`
and `--tool-call-parser openai`, which a gpt-oss deployment takes by default.

A harmony answer is messages, each a header and a body: `<|channel|>analysis<|message|>`
(the prompt ends with `<|start|>assistant`, so the first message opens at its channel),
its text, then `<|end|>`, or the answer's end (`<|return|>`, or `<|call|>` after a call);
the next message opens with `<|start|>assistant`. A header naming a recipient
(`to=functions.get_weather`, before or after the channel, with `<|constrain|>json`) is a
function call whose body is its arguments. The answer's special tokens are kept in its
text for these parsers (as vLLM keeps them for its harmony path) and taken out by them.

- `HarmonyReasoningParser`: the analysis channel is the message's `reasoning`; the final
  and commentary channels' text its content; a call passes on whole, as one normalized
  message, to the tool-call parser.
- parsers/tool/'s `HarmonyToolParser`: calls from those messages (the name without
  `functions.`, the arguments as written, streamed), other messages' text as content.
"""

from __future__ import annotations

import re

from services.gateway.parsers.streamed import StreamedReasoning, partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_OPENERS = (START, CHANNEL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([\w.-]+)")


class HarmonyStream:
    """A harmony text, fed in pieces, as events: ("open", channel, recipient) when a
    message's header is whole, ("text", text) of its body (or of text outside any
    message), ("close",) at its end."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_header = False
        self.header = ""
        self.in_message = False

    def feed(self, text: str) -> list[tuple]:
        self.buffer += text
        events: list[tuple] = []
        while self.buffer:
            if self.in_header:
                at = self.buffer.find(MESSAGE)
                if at < 0:  # (the header so far, less what may begin <|message|>)
                    keep = partial_suffix(self.buffer, MESSAGE)
                    self.header += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                self.header += self.buffer[:at]
                self.buffer, self.in_header, self.in_message = self.buffer[at + len(MESSAGE):], False, True
                channel = _CHANNEL.search(self.header)
                recipient = _RECIPIENT.search(self.header)
                events.append(("open", channel.group(1) if channel else "", recipient.group(1) if recipient else None))
                continue
            found = [(self.buffer.find(m), m) for m in (*_OPENERS, *ENDS)]
            at, marker = min(((i, m) for i, m in found if i >= 0), default=(-1, ""))
            if at < 0:  # (held back: what may begin a marker)
                keep = max(partial_suffix(self.buffer, m) for m in (*_OPENERS, *ENDS, MESSAGE))
                if len(self.buffer) > keep:
                    events.append(("text", self.buffer[: len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            if at:
                events.append(("text", self.buffer[:at]))
            self.buffer = self.buffer[at + len(marker):]
            if self.in_message:  # an end, or a new message that ends this one
                events.append(("close",))
                self.in_message = False
            if marker in _OPENERS:
                self.in_header, self.header = True, marker
        return events

    def finish(self) -> list[tuple]:
        """The answer's end: held text is text; an open message closes."""
        events: list[tuple] = []
        if self.in_header:  # a header cut short: nothing of it is the message's
            self.in_header = False
        elif self.buffer:
            events.append(("text", self.buffer))
        self.buffer = ""
        if self.in_message:
            events.append(("close",))
            self.in_message = False
        return events


class HarmonyReasoningParser(StreamedReasoning):
    def __init__(self) -> None:
        self.stream = HarmonyStream()
        self.route = "content"  # of the open message's text: reasoning, content or call

    def feed(self, text: str) -> tuple[str, str]:
        return self._read(self.stream.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._read(self.stream.finish())

    def _read(self, events: list[tuple]) -> tuple[str, str]:
        reasoning = content = ""
        for event in events:
            if event[0] == "open":
                _, channel, recipient = event
                if recipient is not None:  # a call: on to the tool-call parser, normalized
                    self.route = "call"
                    content += f"{CHANNEL}{channel} to={recipient}{MESSAGE}"
                else:
                    self.route = "reasoning" if channel == "analysis" else "content"
            elif event[0] == "text":
                if self.route == "reasoning":
                    reasoning += event[1]
                else:
                    content += event[1]
            else:  # close
                if self.route == "call":
                    content += ENDS[2]
                self.route = "content"
        return reasoning, content
