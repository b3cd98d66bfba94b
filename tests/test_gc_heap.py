"""The collector kept off the start-up heap (shared/gc_heap.py): a service's process
freezes it once ready, `LLM` for the span of its calls, and nothing freed later is kept."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import weakref

from llmbus.deploy.nats_server import NatsServer, free_port
from shared.gc_heap import frozen_heap


class Cycle:
    """Garbage only the collector frees (a reference cycle)."""

    def __init__(self) -> None:
        self.me = self


def test_a_frozen_heap_keeps_what_was_alive_from_the_collector_and_thaws_after():
    before = Cycle()
    dropped_before = weakref.ref(before)
    del before
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert dropped_before() is not None  # frozen: out of the collector's sight
        during = Cycle()
        dropped_during = weakref.ref(during)
        del during
        gc.collect()
        assert dropped_during() is None  # what the block makes is collected as usual
        with frozen_heap():  # (nested: still frozen after the inner block)
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dropped_before() is None  # thawed: collected at last


def test_generate_runs_with_the_heap_frozen_and_leaves_it_thawed(tiny_llama):
    from llmbus import LLM, SamplingParams

    llm = LLM(str(tiny_llama))
    frozen_while = []
    add_requests = llm.add_requests

    def counted(*args, **kwargs):  # (adding a batch's requests is inside the freeze too)
        frozen_while.append(("add", gc.get_freeze_count() > 0))
        return add_requests(*args, **kwargs)

    llm.add_requests = counted
    step = llm._step

    async def stepped():
        frozen_while.append(("step", gc.get_freeze_count() > 0))
        return await step()

    llm._step = stepped
    outputs = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(outputs[0].outputs[0].token_ids) == 3
    assert frozen_while[0] == ("add", True) and len(frozen_while) >= 4
    assert all(frozen for _, frozen in frozen_while)
    assert gc.get_freeze_count() == 0


def _service_log(argv: list[str], ready: str, code: int, timeout_s: float = 60) -> str:
    """`python -m llmbus -v ARGV` until it logs `ready`, then Ctrl-C: its whole log (it
    must exit with `code`)."""
    proc = subprocess.Popen([sys.executable, "-m", "llmbus", "-v", *argv], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    give_up = threading.Timer(timeout_s, proc.send_signal, [signal.SIGINT])  # (never ready: its log says why)
    give_up.start()
    try:
        for line in proc.stderr:
            lines.append(line)
            if ready in line:
                break
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        give_up.cancel()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, "".join(lines) + rest
    return "".join(lines) + rest


def test_every_service_command_freezes_its_heap_once_ready(tiny_llama):
    """As compose and `llmbus serve` start them; the worker's heap (torch, the model,
    Triton's and xgrammar's extensions) is the one a full collection walks for longest.
    Thawed at exit: no extension reports objects never finalized."""
    nats = NatsServer().start()
    model = ["--model", str(tiny_llama)]
    try:
        # (uvicorn ends a Ctrl-C'd gateway as a Ctrl-C ends a program, 130, with no traceback)
        for service, argv, code in (("worker", ["worker", *model, "--num-kv-blocks", "16"], 0),
                                    ("scheduler", ["scheduler", *model], 0),
                                    ("tokenizer", ["tokenizer", *model], 0),
                                    ("gateway", ["gateway", *model, "--port", str(free_port())], 130)):
            log = _service_log([*argv, "--nats-url", nats.url], f"{service} froze its start-up heap", code)
            froze = [line for line in log.splitlines() if f"{service} froze its start-up heap" in line]
            assert len(froze) == 1, log
            line = froze[0]
            assert '"objects": ' in line and int(line.split('"objects": ')[1].split(",")[0]) > 10_000
            assert "leaked" not in log and "Traceback" not in log, log
    finally:
        nats.stop()


def test_a_dropped_llm_closes_its_event_loop(tiny_llama):
    """Left to the collector, an unclosed loop's finalizer could run after its self-pipe
    socket's, and print a traceback of a closed descriptor (it did in CI, once garbage
    from before a `generate` waited for a full collection)."""
    from llmbus import LLM, SamplingParams

    llm = LLM(str(tiny_llama))
    llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=2))
    loop = llm._loop
    del llm
    gc.collect()
    assert loop.is_closed()
