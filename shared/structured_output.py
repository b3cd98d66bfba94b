"""Constraints sample where sampling happens: a grammar matcher per constrained request,
on xgrammar. This module compiles specs and builds matchers (the worker, and the tokenizer
replicas that check a spec first, use it); the worker's sample/grammar.py masks logits.

The spec (`StructuredOutputsParams`) travels with the request; the bitmask never leaves
the worker. A request new to the worker (first step, resumed, preempted, migrated) gets
a fresh matcher with the tokens it already has replayed into it, so a constraint
survives every way a request moves. Each step fills the bitmask of the constrained rows
after the previous step's tokens were accepted (steps run in order on one thread, so a
step in flight never samples a token the grammar forbids), masks the logits, and the
sampled token advances the matcher. With speculation, each draft position's row is
masked by the grammar after the drafts before it (the matcher steps through the drafts
and is rolled back), and a draft the grammar refuses ends what may be accepted.

Who waits for a compile: only its request. Matchers are built on a thread of their own
(xgrammar releases the GIL while it compiles), started when the request reaches the
worker, so a compile overlaps the request's prefill and everyone else's steps. A request
that reaches its sampling point before its matcher is ready samples nothing that step
and is sent back to be computed again (`ModelRunnerOutput.resample_req_ids`); a spec
that fails to compile here fails that request alone (`request_errors`). The tokenizer's
view xgrammar needs is built on that thread too, as the worker starts (`warm_up`).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

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
        self.model_path = model_path
        # The model's logits may be wider than the tokenizer's vocabulary (padding rows).
        self.vocab_size = vocab_size
        self._compiler = None  # built with the first matcher, on the compile thread
        self._building = threading.Lock()  # (or by a check on the step thread: once)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def compiler(self):
        with self._building:
            return self._compiler or self._build_compiler()

    def _build_compiler(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        c = self.compiler
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else '{"type": "object"}'
            return c.compile_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_regex("|".join(_regex_literal(choice) for choice in spec.choice))
        if is_lark(spec.grammar):  # (Outlines' CFGs, many vLLM users': vLLM converts them, xgrammar reads them)
            import xgrammar as xgr

            return c.compile_grammar(xgr.Grammar.from_lark(spec.grammar))
        return c.compile_grammar(spec.grammar)

    def check(self, spec: StructuredOutputsParams):
        """Compiled (and cached); a spec xgrammar refuses is a ValueError saying why."""
        try:
            return self.compile(spec)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs: {_without_log_prefix(str(exc))}") from exc

    def matcher(self, spec: StructuredOutputsParams, output_token_ids: list[int]):
        """A matcher at the end of the tokens the request already has."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.check(spec))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} already generated does not fit the request's grammar")
        return matcher

    def warm_up(self) -> Future:
        """Build the tokenizer's view on the compile thread now, not with the first
        constrained request. Wait for it before serving: building it holds the GIL for
        stretches of ~0.5 s (xgrammar's vocabulary pass), and a step on the step thread
        waits them out (a 13 ms decode step took 525 ms beside it, on this CPU)."""
        return self._compile_thread().submit(lambda: self.compiler)

    def _compile_thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool

    def start_matcher(self, spec: StructuredOutputsParams, output_token_ids: list[int]) -> Future:
        """`matcher(...)` on the compile thread; one thread, so compiles queue in order."""
        return self._compile_thread().submit(self.matcher, spec, list(output_token_ids))


def is_lark(grammar: str) -> bool:
    """Lark's syntax, not xgrammar's EBNF: no rule defined with `::=` (EBNF's), one with
    `:` or a `%` directive (vLLM tells them apart so too)."""
    lines = [line.split("//", 1)[0].strip() for line in grammar.splitlines()]
    return "::=" not in grammar and any(line.startswith("%") or re.match(r"[?!]?[\w.]+\s*:", line)
                                        for line in lines)


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches it exactly (xgrammar's regex dialect)."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}" else ch for ch in text)


# xgrammar's C++ errors begin with its log line's time and source position
# ("[22:10:48] /project/cpp/regex_converter.cc:94: "): a client is told what, not where.
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")


def _without_log_prefix(message: str) -> str:
    return _XGRAMMAR_LOG_PREFIX.sub("", message).strip()
