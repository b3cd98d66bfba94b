"""Structured-output specs checked on the request path, before the engine sees them.

The gateway asks a tokenizer replica (it has the tokenizer xgrammar needs) to compile a
request's spec, so a bad or runaway one is a 400 before any response header goes out.
Compiles run in a child process: one that outlives its timeout is killed with its
process (a thread could not be), and the next check starts a fresh one. Good specs are
remembered; the worker compiles again from its own cache.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading

import msgspec

from shared.sampling_params import StructuredOutputsParams

log = logging.getLogger("llmbus.tokenizer")

_backend = None  # the child's GrammarBackend


def _init_child(model_path: str) -> None:
    global _backend
    from shared.structured_output import GrammarBackend
    from transformers import AutoTokenizer

    _backend = GrammarBackend(model_path, len(AutoTokenizer.from_pretrained(model_path)))


def _compile_in_child(spec_json: bytes) -> str | None:
    try:
        _backend.check(msgspec.json.decode(spec_json, type=StructuredOutputsParams))
    except ValueError as exc:
        return str(exc)
    return None


class GrammarChecker:
    def __init__(self, model_path: str, timeout_s: float = 5.0) -> None:
        self.model_path = model_path
        self.timeout_s = timeout_s
        self._known_good: set[bytes] = set()
        self._lock = threading.Lock()  # one compile at a time: the child has one core's worth
        self._pool = None
        self._closed = threading.Event()
        self._child_init = (_init_child, (model_path,))  # (what the child runs first: loads the vocabulary)

    def _start(self):
        """The child, started (its vocabulary loaded) outside any compile's timeout; None
        once closed. The start can take many seconds on a busy host (it imports xgrammar,
        torch and transformers), so a shutdown must not wait for it to finish."""
        if self._pool is None and not self._closed.is_set():
            ctx = multiprocessing.get_context("spawn")
            initializer, initargs = self._child_init
            self._pool = ctx.Pool(1, initializer=initializer, initargs=initargs)
            probe = self._pool.apply_async(_compile_in_child, (msgspec.json.encode(StructuredOutputsParams(regex="x")),))
            while not probe.ready():
                if self._closed.wait(0.1):
                    # Closed while the child started: close() may have run before the pool
                    # was ours to end (a Ctrl-C at start-up), so it is ended here; left
                    # alone, its finalizer complained at exit of pipes already closed.
                    pool, self._pool = self._pool, None
                    if pool is not None:
                        pool.terminate()
                    return None
            probe.get()  # the child's own failure, raised here
        return self._pool

    def warm_up(self) -> None:
        """Start the child now (blocking: ~2 s for SmolLM2's vocabulary on an idle host), so
        the first request with a spec does not wait for it."""
        with self._lock:
            try:
                self._start()
            except ValueError:  # "Pool not running": closed between creating the child and asking it
                if not self._closed.is_set():
                    raise

    def check(self, spec: StructuredOutputsParams) -> str | None:
        """None if the spec compiles, else why not (blocking: call it off the event loop)."""
        key = msgspec.json.encode(spec)
        if key in self._known_good:
            return None
        with self._lock:
            pool = self._start()
            if pool is None:
                return "structured_outputs: the tokenizer is shutting down"
            pending = pool.apply_async(_compile_in_child, (key,))
            try:
                error = pending.get(self.timeout_s)
            except multiprocessing.TimeoutError:
                log.warning("a structured-output spec did not compile within %.1f s; its compile was killed",
                            self.timeout_s)
                pool.terminate()
                self._pool = None
                threading.Thread(target=self.warm_up, daemon=True).start()  # the next spec's child
                return f"structured_outputs: the spec did not compile within {self.timeout_s:g} s"
        if error is None:
            self._known_good.add(key)
        return error

    def close(self) -> None:
        """End the child, even one still starting (a warm-up under way returns at once)."""
        self._closed.set()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
