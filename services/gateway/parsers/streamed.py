"""What the streaming parsers share: text held back while it may still be a tag, and the
reasoning parsers' interface."""

from __future__ import annotations


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class StreamedReasoning:
    """A parser fed a choice's text deltas (`feed`, then `finish`), (reasoning, content)
    each; a whole answer is the same calls at once, so both agree by construction."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...

    def whole(self, text: str) -> tuple[str, str]:
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content
