"""Incremental detokenization and stop strings, per request.

Text grows token by token through `tokenizers`' DecodeStream, which holds back bytes
until they form whole UTF-8 characters. Stop strings are looked for in the text (so
they match across token boundaries) and never shown: when streaming, the last
`len(longest stop) - 1` characters are held back until they can no longer start one.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens given to the stream as context, so the first output token decodes with
# the spacing it has after the prompt.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self.stop = list(stop or [])
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.output_text = ""
        self._num_sent = 0  # characters already handed out by get_delta
        self.stop_string: str | None = None
        self._pending: list[int] = []  # tokens stepped in that have not produced text yet

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string when one appeared (the text then ends before it)."""
        for token_id in new_token_ids:
            if self.stop_string is not None:
                break
            piece = self._stream.step(self._tokenizer, token_id)
            if not piece:
                self._pending.append(token_id)
                continue
            self._pending.clear()
            old_len = len(self.output_text)
            self.output_text += piece
            if self.stop:
                self._check_stop(old_len)
        return self.stop_string

    def flush(self) -> None:
        """At the end, bytes that never completed a character become U+FFFD, as in a plain
        decode, rather than vanishing."""
        if self._pending and self.stop_string is None:
            self.output_text += self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special)
            self._pending.clear()

    def _check_stop(self, old_len: int) -> None:
        # Only a match that ends in the new piece is new; it may start earlier.
        search_from = max(0, old_len - self._holdback)
        best = None
        for stop in self.stop:
            at = self.output_text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.output_text = self.output_text[: best[0]]
            self.stop_string = best[1]

    def get_delta(self, finished: bool) -> str:
        """Text not handed out yet, keeping back what might still become a stop string."""
        end = len(self.output_text)
        if not finished and self.stop_string is None:
            end = max(self._num_sent, end - self._holdback)
        delta = self.output_text[self._num_sent : end]
        self._num_sent = end
        return delta
