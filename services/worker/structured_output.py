"""Constraints sample where sampling happens: a grammar matcher per constrained request,
on xgrammar.

The spec (`StructuredOutputsParams`) travels with the request; the bitmask never leaves
the worker. A request new to the worker (first step, resumed, preempted, migrated) gets
a fresh matcher with the tokens it already has replayed into it, so a constraint
survives every way a request moves. Each step fills the bitmask of the constrained rows
after the previous step's tokens were accepted (steps run in order on one thread, so a
step in flight never samples a token the grammar forbids), masks the logits, and the
sampled token advances the matcher.

Grammars compile here through xgrammar's compiler cache, on the step thread: a new
spec's first compile holds up that step (the gateway checks and compiles specs before
they reach the engine, so this one is a cache hit or a known-good spec).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shared.sampling_params import StructuredOutputsParams

# JSON without runaway whitespace (the failure peers' users report most: JSON padded with
# spaces and newlines to max_tokens): the grammar fixes the separators, ", " and ": ", as
# vLLM's disable_any_whitespace does. Bounding free whitespace instead (xgrammar's
# max_whitespace_cnt) still let a small model spend 40 tokens on 4-character runs between
# every key and value.
JSON_SEPARATORS = (", ", ": ")


class GrammarBackend:
    """The tokenizer's view for xgrammar, a compiler with its cache, and matchers."""

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._xgr = xgr
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        # The model's logits may be wider than the tokenizer's vocabulary (padding rows).
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)

    def compile(self, spec: StructuredOutputsParams):
        c = self.compiler
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else '{"type": "object"}'
            return c.compile_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_regex("|".join(_regex_literal(choice) for choice in spec.choice))
        return c.compile_grammar(spec.grammar)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile (into the cache); a spec xgrammar refuses is a ValueError saying why."""
        try:
            self.compile(spec)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs: {exc}") from exc

    def matcher(self, spec: StructuredOutputsParams, output_token_ids: list[int]):
        """A matcher at the end of the tokens the request already has."""
        matcher = self._xgr.GrammarMatcher(self.compile(spec))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} already generated does not fit the request's grammar")
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """In place: every token the row's grammar does not allow next gets -inf."""
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches it exactly (xgrammar's regex dialect)."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}" else ch for ch in text)
