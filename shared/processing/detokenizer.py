"""Incremental detokenization and stop strings, per request.

Text grows token by token through `tokenizers`' DecodeStream, which holds back bytes
until they form whole UTF-8 characters. Stop strings are looked for in the text (so
they match across token boundaries) and never shown: when streaming, the last
`len(longest stop) - 1` characters are held back until they can no longer start one.

A reader that wants the text only at the end (`LLM.generate`, a response that is not
streamed) and has no stop string to look for gets it in one decode when the request
finishes: one call for the whole output instead of a DecodeStream step and its Python a
token — the largest share of an offline decode step's host work (docs/performance/history.md).
The text is the same: the output's tokens decoded after the same prompt context, less the
context's own text, which is what the stream's steps add up to.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens given to the stream as context, so the first output token decodes with
# the spacing it has after the prompt: the last 4, or more when those 4 begin inside a
# character (their text would start with U+FFFD, which the stream then gives out as the
# output's first text) — up to 24, as vLLM's detokenizer looks.
_CONTEXT_TOKENS = 4
_MAX_CONTEXT_TOKENS = 24


def prompt_context(tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    for n in range(_CONTEXT_TOKENS, min(len(prompt_token_ids), _MAX_CONTEXT_TOKENS) + 1):
        context = list(prompt_token_ids[-n:])
        if "\ufffd" not in tokenizer.decode(context, skip_special_tokens=skip_special_tokens):
            return context
    return list(prompt_token_ids[-_CONTEXT_TOKENS:])


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        incremental: bool = True,  # False: the text is wanted only once the request is over
        include_stop: bool = False,  # the stop string that ends the text stays in it
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._context = prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = list(stop or [])
        self._include_stop = include_stop
        # Stop strings are looked for as the text grows, so they need it token by token.
        self.incremental = incremental or bool(self.stop)
        self._stream = self._new_stream(self._context) if self.incremental else None
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.output_text = ""
        self._num_sent = 0  # characters already handed out by get_delta
        self.stop_string: str | None = None
        # Tokens stepped in that have not produced text yet (all of them, not incremental).
        self._pending: list[int] = []

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string when one appeared (the text then ends before it)."""
        if self._stream is None:
            self._pending += new_token_ids
            return None
        for token_id in new_token_ids:
            if self.stop_string is not None:
                break
            try:
                piece = self._stream.step(self._tokenizer, token_id)
            except Exception:  # noqa: BLE001 - tokenizers' own (untyped) error
                piece = self._restart_stream(token_id)
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
        decode, rather than vanishing. Not incremental: the whole text, now."""
        if self._stream is None and self._pending:
            self._decode_whole()
        if self._pending and self.stop_string is None:
            self.output_text += self._tokenizer.decode(self._pending, skip_special_tokens=self._skip_special)
            self._pending.clear()

    def _new_stream(self, context: list[int]) -> DecodeStream:
        return DecodeStream(ids=context, skip_special_tokens=self._skip_special)

    def _restart_stream(self, token_id: int) -> str:
        """The stream's "invalid prefix": with byte fallback, a byte that forms no character
        can turn the text before it into U+FFFD too, so the text given out is no longer a
        prefix (Llama-2, Mistral, Phi-3 sampling byte tokens at a high temperature). The
        tokens not given out yet become text on their own, and a new stream starts after
        them — the request goes on, rather than failing with its batch offline."""
        ids = self._pending + [token_id]
        self._pending = []
        self._stream = self._new_stream(ids[-_CONTEXT_TOKENS:])
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_whole(self) -> None:
        ids, self._pending = self._pending, []
        decode, skip = self._tokenizer.decode, self._skip_special
        context_text = decode(self._context, skip_special_tokens=skip)
        whole = decode(self._context + ids, skip_special_tokens=skip)
        if "\ufffd" not in whole and whole.startswith(context_text):
            self.output_text = whole[len(context_text):]
            return
        # Bytes that form no character somewhere (or a context that ends inside one: a
        # prompt of token ids cut there): decoders differ on how many U+FFFD a run of such
        # bytes becomes at once (byte fallback makes each byte one, the stream gives the
        # valid ones their characters), so the stream says what text they are.
        self._stream = self._new_stream(self._context)
        self.update(ids)

    def _check_stop(self, old_len: int) -> None:
        # Only a match that ends in the new piece is new; it may start earlier.
        search_from = max(0, old_len - self._holdback)
        best = None
        for stop in self.stop:
            at = self.output_text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.output_text = self.output_text[: best[0] + (len(best[1]) if self._include_stop else 0)]
            self.stop_string = best[1]

    def get_delta(self, finished: bool) -> str:
        """Text not handed out yet, keeping back what might still become a stop string."""
        if self._stream is None and not finished:
            return ""  # (not incremental: nothing before the end)
        end = len(self.output_text)
        if not finished and self.stop_string is None:
            end = max(self._num_sent, end - self._holdback)
        delta = self.output_text[self._num_sent : end]
        self._num_sent = end
        return delta
