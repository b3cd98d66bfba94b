"""Structured outputs in the engine (xgrammar, a matcher per request in the worker): greedy
constrained output equals transformers' generate under xgrammar's own logits processor
token for token, the text satisfies its spec and ends with `stop` where the grammar
ends, and a constraint survives preemption (the matcher is rebuilt by replaying)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus import LLM, SamplingParams
from shared.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
SPECS = {
    "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    "json": StructuredOutputsParams(json=SCHEMA),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" ("a" | "b")+ ")"'),
    # (Lark's syntax, as Outlines' CFG type and many vLLM users send it: the same language)
    "lark": StructuredOutputsParams(grammar='// Lark\n?start: "(" item+ ")"\nitem: "a" | "b"'),
}
# Text prompts: random token ids can end in half a UTF-8 character, which the detokenizer
# then completes with the first output token (true to the tokens, but no longer the spec).
TEXTS = ["The answer is", "Give me JSON:", "Paged attention keeps"]
MAX_TOKENS = 40


def satisfies(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2}", text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe so")
    if kind == "json":
        import jsonschema  # here, so scripts/gpu_check.py can take this file's cases without it

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return re.fullmatch(r"\((a|b)+\)", text) is not None


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama))


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(text) for text in TEXTS]


def hf_constrained(folder, spec: StructuredOutputsParams, prompts, device: str = "cpu") -> list[list[int]]:
    """The oracle: transformers' greedy generate masked by xgrammar's logits processor
    (scripts/gpu_check.py runs it on the GPU)."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.structured_output import GrammarBackend

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    backend = GrammarBackend(folder, model.config.vocab_size)
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
                logits_processor=[xgr.contrib.hf.LogitsProcessor(backend.compile(spec))],
            )
            tokens = out[0, len(prompt):].tolist()
            if tokens and tokens[-1] == tokenizer.eos_token_id:
                tokens = tokens[:-1]  # we report the text, the stop token ends it
            results.append(tokens)
    return results


@pytest.mark.parametrize("kind", list(SPECS))
def test_constrained_greedy_output_equals_transformers_with_xgrammar(llm, prompts, tiny_llama, kind):
    spec = SPECS[kind]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    outs = llm.generate(prompts, params)
    expected = hf_constrained(tiny_llama, spec, prompts)
    got = [[t for t in o.outputs[0].token_ids if t != llm.eos_token_id] for o in outs]
    assert got == expected
    for out in outs:
        assert satisfies(kind, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"


def test_seeded_sampling_stays_inside_the_grammar(llm, prompts):
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=MAX_TOKENS, structured_outputs=SPECS["json"])
    for out in llm.generate(prompts, params):
        for choice in out.outputs:
            assert satisfies("json", choice.text) and choice.finish_reason == "stop"


def test_a_preempted_request_keeps_its_constraint(tiny_llama, llm):
    """Preempted requests come back as new to the worker: the matcher is rebuilt from
    their tokens, and the output is the one of a run without preemption."""
    spec = SPECS["json"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)
    prompts = [llm.tokenizer.encode(f"{text} " * 4) for text in TEXTS + ["Once upon a time"]]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    tight = LLM(str(tiny_llama), num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    outs = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == free


def test_unconstrained_requests_beside_constrained_ones_are_untouched(llm, prompts):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate([prompts[0]], plain)
    both = llm.generate([prompts[0], prompts[1]], [plain, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                         structured_outputs=SPECS["regex"])])
    assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert satisfies("regex", both[1].outputs[0].text)


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(regex="[0-9"),
    StructuredOutputsParams(json='{"type": "no-such-type"}'),
    StructuredOutputsParams(grammar="root ::= undefined_rule"),
])
def test_a_spec_xgrammar_refuses_is_a_value_error_before_anything_runs(llm, prompts, spec):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [expected] = llm.generate([prompts[0]], plain)
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate([prompts[0], prompts[1]], [plain, SamplingParams(max_tokens=6, structured_outputs=spec)])
    assert not llm.scheduler.has_unfinished_requests()
    [again] = llm.generate([prompts[0]], plain)
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids


@pytest.mark.parametrize("spec, message", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["b"]), "exactly one"),
    (dict(choice=[]), "choice"),
])
def test_a_spec_must_name_exactly_one_constraint(spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=message):  # (given as a dict, the same spec)
        SamplingParams(structured_outputs=spec)


def test_a_spec_given_as_a_dict_constrains_as_the_params_do(llm, prompts):
    """Offline, as a served request's `structured_outputs` field reads (it was an
    AttributeError from deep in the engine)."""
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    [out] = llm.generate([prompts[0]], params)
    assert out.outputs[0].text in ("yes", "no")
    with pytest.raises(TypeError, match="jsn"):
        SamplingParams(structured_outputs={"jsn": {}})


# ---- who waits for a compile ------------------------------------------------------------


def test_a_slow_compile_holds_up_its_own_request_and_no_other(tiny_llama, monkeypatch):
    """The worker builds matchers on a thread of their own: while one is held back, the
    request beside it runs to its end; released, the constrained request's output is the
    one a fast compile gives (its last prompt token computed again, then sampled)."""
    import threading

    from shared.structured_output import GrammarBackend

    llm = LLM(str(tiny_llama))
    prompts = [llm.tokenizer.encode(text) for text in TEXTS[:2]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=SPECS["json"])]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    release = threading.Event()
    build = GrammarBackend.matcher

    def held(self, spec, output_token_ids):  # the compile thread's job, until the test lets it go
        assert release.wait(60)
        return build(self, spec, output_token_ids)

    monkeypatch.setattr(GrammarBackend, "matcher", held)
    plain, constrained = llm.add_requests(prompts, params)
    steps = 0
    while not plain.finished:
        llm.step()
        steps += 1
    assert plain.outputs[0].token_ids == expected[0] and steps >= 24
    assert constrained.outputs[0].token_ids == []  # still waiting for its grammar
    release.set()
    while not constrained.finished:
        llm.step()
    assert constrained.outputs[0].token_ids == expected[1]
    assert satisfies("json", constrained.outputs[0].text)


def test_a_grammar_that_fails_on_the_worker_fails_its_request_alone():
    """The scheduler's side: a request error ends that request with its reason; a request
    sent back unsampled computes its last token again, and is not pipelined meanwhile."""
    from test_scheduler import make_request, make_scheduler

    from shared.messages import FinishReason, ModelRunnerOutput

    scheduler = make_scheduler()
    spec = StructuredOutputsParams(regex="a+")
    scheduler.add_request(make_request("plain", [1, 2, 3], max_tokens=5))
    scheduler.add_request(make_request("json", [4, 5, 6], max_tokens=5, structured_outputs=spec))
    scheduler.add_request(make_request("bad", [7, 8, 9], max_tokens=5, structured_outputs=spec))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"plain": 3, "json": 3, "bad": 3}
    # Built while the first is in flight (async scheduling): the constrained ones wait.
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"plain": 1}
    outs = scheduler.update_from_output(first, ModelRunnerOutput(
        first.step_id, ["plain", "json", "bad"], [[11], [], []], resample_req_ids=["json"],
        request_errors={"bad": "structured_outputs: no such rule"}))
    by_id = {o.request_id: o for o in outs[""].outputs}
    assert set(by_id) == {"plain", "bad"} and by_id["plain"].new_token_ids == [11]
    assert (by_id["bad"].finish_reason, by_id["bad"].error) == (FinishReason.ERROR, "structured_outputs: no such rule")
    scheduler.update_from_output(second, ModelRunnerOutput(second.step_id, ["plain"], [[12]]))
    third = scheduler.schedule()
    # The constrained request's last prompt token again (at position 2), the plain one's decode.
    assert third.num_scheduled_tokens == {"plain": 1, "json": 1}
    assert third.scheduled_cached_reqs.num_computed_tokens == [4, 2]
    outs = scheduler.update_from_output(third, ModelRunnerOutput(third.step_id, ["plain", "json"], [[13], [14]]))
    assert {o.request_id: o.new_token_ids for o in outs[""].outputs} == {"plain": [13], "json": [14]}
    assert "bad" not in scheduler.requests


def test_a_compile_that_fails_on_the_worker_ends_that_request_and_the_engine_goes_on(tiny_llama, monkeypatch):
    from shared.structured_output import GrammarBackend

    llm = LLM(str(tiny_llama))
    prompts = [llm.tokenizer.encode(text) for text in TEXTS[:2]]
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [expected] = llm.generate(prompts[:1], plain)

    def fails(self, spec, output_token_ids):
        raise ValueError("structured_outputs: this worker cannot")

    monkeypatch.setattr(GrammarBackend, "matcher", fails)
    with pytest.raises(RuntimeError, match="this worker cannot"):
        llm.generate(prompts, [plain, SamplingParams(temperature=0, structured_outputs=SPECS["regex"])])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], plain)] == [expected.outputs[0].token_ids]



def test_min_tokens_with_a_grammar_is_refused_rather_than_forcing_tokens_past_its_end():
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=10, structured_outputs=SPECS["choice"])


@settings(deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6), st.integers(33, 100), st.integers(0, 8))
def test_a_greedy_row_whose_argmax_the_grammar_allows_samples_the_same_unmasked(seed, num_rows, vocab, extra):
    """The CPU skips masking plain greedy rows whose argmax is allowed: the argmax over
    every row is the one full masking gives (a model's padding ids past the tokenizer's
    vocabulary too, which the worker's bitmask covers and never allows), and only rows
    whose argmax is allowed are skipped."""
    import xgrammar as xgr

    from services.worker.sample.grammar import _rows_to_mask

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab + extra, generator=generator)
    allowed = torch.rand(num_rows, vocab, generator=generator) < 0.5
    allowed[:, 0] = True  # a grammar always allows something
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab + extra)  # as the worker's: the logits' width
    for r in range(num_rows):
        for word in range(bitmask.shape[1]):
            bits = [int(allowed[r, t]) if t < vocab else 0 for t in range(32 * word, 32 * word + 32)]
            bitmask[r, word] = int.from_bytes(int("".join(map(str, reversed(bits))), 2).to_bytes(4, "little"),
                                              "little", signed=True)
    rows = list(range(num_rows))
    full = logits.clone()
    xgr.apply_token_bitmask_inplace(full, bitmask, indices=rows)
    partial = logits.clone()
    to_mask = _rows_to_mask(partial, bitmask, rows, frozenset(rows))
    if to_mask:
        xgr.apply_token_bitmask_inplace(partial, bitmask, indices=to_mask)
    assert partial.argmax(-1).tolist() == full.argmax(-1).tolist()
    top = logits.argmax(-1).tolist()
    assert to_mask == [r for r in rows if not (top[r] < vocab and allowed[r, top[r]])]


def test_the_worker_builds_the_grammar_compiler_before_it_joins_the_bus(tiny_llama, monkeypatch):
    """Building xgrammar's view of the vocabulary holds the GIL for stretches (~0.5 s with
    SmolLM2's): a worker that joined first ran its first steps beside it, and a GPU's first
    requests took seconds. The worker connects to the bus only once it is built."""
    import asyncio
    import time

    from services.worker.shell import service
    from shared.structured_output import GrammarBackend
    from shared.config import CacheConfig, WorkerConfig

    built, connected_after_build = [], []
    build = GrammarBackend._build_compiler

    def slow_build(self):
        time.sleep(0.5)
        built.append(True)
        return build(self)

    class Joined(Exception):
        pass

    async def connect(*args, **kwargs):
        connected_after_build.append(bool(built))
        raise Joined

    monkeypatch.setattr(GrammarBackend, "_build_compiler", slow_build)
    monkeypatch.setattr(service, "connect", connect)
    with pytest.raises(Joined):
        asyncio.run(service.serve(str(tiny_llama), "nats://127.0.0.1:1", "tiny",
                                  WorkerConfig(CacheConfig(num_kv_blocks=16))))
    assert connected_after_build == [True]
