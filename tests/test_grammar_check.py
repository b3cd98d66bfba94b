"""The tokenizer's spec check: compiles in a child process, remembers good specs, says why
a bad one is bad, and kills a compile that outlives its timeout (the next starts afresh)."""

import threading
import time

import psutil
import pytest

from services.tokenizer.grammar_check import GrammarChecker
from shared.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def checker(tiny_llama):
    checker = GrammarChecker(str(tiny_llama), timeout_s=30.0)
    yield checker
    checker.close()


def test_a_good_spec_passes_and_is_remembered(checker):
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert checker.check(spec) is None
    assert len(checker._known_good) >= 1
    assert checker.check(spec) is None


@pytest.mark.parametrize(("spec", "why"), [(StructuredOutputsParams(regex="[0-9"), "Regex parsing error"),
                                           (StructuredOutputsParams(grammar="root ::= missing"), "EBNF parser error"),
                                           (StructuredOutputsParams(grammar="start: missing"), "Lark error"),
                                           (StructuredOutputsParams(json={"type": "nonsense"}), "Unsupported type")])
def test_a_bad_spec_says_why(checker, spec, why):
    """What xgrammar found, without its log line's time and C++ source position."""
    message = checker.check(spec)
    assert message.startswith(f"structured_outputs: {why}") and ".cc:" not in message and message == message.strip()


# Seconds of compile even over the tiny vocabulary (60 alternatives: ~0.15 s here), so a
# short timeout is past whatever the machine's load does to the waiting thread (a regex that
# compiles in 2 ms once finished inside a 1 us timeout, the thread descheduled in between).
RUNAWAY = "(" + "|".join(f"[a-z]{{{i},{i + 50}}}x" for i in range(240)) + "){1,5}"


def test_a_compile_past_its_timeout_is_killed_and_the_next_starts_afresh(checker):
    checker.check(StructuredOutputsParams(regex="warm"))  # the child is up
    first = checker._pool
    checker.timeout_s = 0.05
    try:
        message = checker.check(StructuredOutputsParams(regex=RUNAWAY))
    finally:
        checker.timeout_s = 30.0
    assert "did not compile within" in message
    assert checker._pool is None and first is not None
    assert checker.check(StructuredOutputsParams(choice=["after", "the kill"])) is None  # a new child


@pytest.mark.parametrize("command", ["tokenizer", "serve"])
def test_a_compile_timeout_the_gateway_cannot_wait_for_is_refused_at_start(command, capsys, monkeypatch):
    """The gateway waits 30 s for a check (a replica's first also starts its child): a longer
    compile timeout would be answered as a tokenizer time-out instead of the spec's 400."""
    from llmbus.cli.main import build_parser

    for bad in ("40", "0"):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args([command, "--structured-outputs-compile-timeout", bad])
        assert exit_info.value.code == 2 and "at most 25 seconds" in capsys.readouterr().err
    assert build_parser().parse_args([command, "--structured-outputs-compile-timeout", "12"]) \
        .structured_outputs_compile_timeout == 12.0
    monkeypatch.setenv("LLMBUS_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT", "7.5")  # as llmbus serve hands it on
    assert build_parser().parse_args([command]).structured_outputs_compile_timeout == 7.5


def test_closing_ends_a_child_still_starting_at_once(tiny_llama):
    """A shutdown does not wait out the child's start (xgrammar, torch and transformers to
    import: many seconds on a busy host): the warm-up returns and the child is gone."""
    checker = GrammarChecker(str(tiny_llama))
    checker._child_init = (time.sleep, (120,))  # a start that would take two minutes
    warming = threading.Thread(target=checker.warm_up)
    warming.start()
    deadline = time.monotonic() + 30
    while checker._pool is None and time.monotonic() < deadline:
        time.sleep(0.05)
    children = [psutil.Process(p.pid) for p in checker._pool._pool]  # (the pool's workers)
    assert children, "the child never started"
    checker.close()
    warming.join(10)
    assert not warming.is_alive()
    psutil.wait_procs(children, timeout=10)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert checker.check(StructuredOutputsParams(regex="x")) == "structured_outputs: the tokenizer is shutting down"
