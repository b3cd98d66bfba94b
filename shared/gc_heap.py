"""Python's garbage collector kept off the start-up heap (vLLM's `freeze_gc_heap`).

A process that has imported torch and loaded a model tracks hundreds of thousands of
container objects (a SmolLM2 worker ~385k), and CPython's full collection walks every
one: 146-161 ms, once in the middle of each offline batch measured (docs/performance/history.md,
"The garbage collector"), with every request's next token waiting. None of those objects
is garbage: modules, the model, the tokenizer live as long as the process. `gc.freeze()`
moves them out of the collector's sight; what is allocated later is collected as before.

Services freeze once, ready to serve (`freeze_heap`, from their command's entry: a test
that runs a service inside its own process keeps its heap as it was). `LLM` lives in its
caller's process, whose objects are not ours to freeze for good: it freezes the heap for
the span of a call (`generate`, `step_while`) and thaws it after (`frozen_heap`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import time

log = logging.getLogger("llmbus.gc")


_frozen_for_good = False
_depth = 0  # frozen_heap blocks entered, not left


def freeze_heap(service: str) -> None:
    """Collect once, then freeze everything alive, for good (a service's process, ready)."""
    global _frozen_for_good
    start = time.perf_counter()
    gc.collect()  # (garbage frozen would never be collected)
    collect_ms = (time.perf_counter() - start) * 1e3
    gc.freeze()
    _frozen_for_good = True
    # Thawed at exit, so the interpreter's last collection still finalizes what the heap
    # holds (nanobind's extensions, Triton's among them, report objects never finalized as leaks).
    atexit.register(gc.unfreeze)
    count = gc.get_freeze_count()  # (walks the frozen objects: once)
    log.info("%s froze its start-up heap: %d objects, a full collection of them %.0f ms", service, count,
             collect_ms, extra={"objects": count, "collect_ms": round(collect_ms, 1)})


@contextlib.contextmanager
def frozen_heap():
    """The heap as it is now out of the collector's sight while the block runs, then
    back (a freeze and a thaw each move whole generations: nothing is walked). Inside
    another such block, or where the heap is frozen already, it stays as it is."""
    global _depth
    # (get_freeze_count walks what is frozen: asked only where this module froze nothing)
    if _depth or _frozen_for_good or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        gc.unfreeze()
