"""N-gram speculative decoding: greedy output with speculation equals transformers token for
token (plain, chunked prefill, prefix hits, preemption), seeded sampling is identical
with and without it whatever shares the batch, max_tokens and stop strings are exact, no
block leaks and no draft ever reaches the prefix cache, and drafts are in fact accepted
(each test checks the counters, so a speculation that quietly never ran fails it)."""

from __future__ import annotations

import pytest

from llmbus import LLM, SamplingParams
from services.scheduler.core.block_pool import hash_block_tokens
from services.worker.sample.spec_decode import NgramProposer, num_accepted
from shared.config import SpeculativeConfig
from tiny_models import hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Repetitive prompts: a random model's greedy output also falls into cycles soon, which is
# where prompt lookup finds its drafts.
TEXTS = ["the cat sat on the mat, the cat sat on the mat, the cat", "1 2 3 4 5 1 2 3 4 5 1 2 3",
         "abc abc abc abc", "Paged attention keeps"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def spec_llm(tiny_llama):
    return LLM(str(tiny_llama), speculative_config=SPEC)


@pytest.fixture(scope="module")
def prompts(spec_llm):
    return [spec_llm.tokenizer.encode(text) for text in TEXTS]


def accepted_since(llm: LLM, before) -> int:
    return llm.stats().spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens


def test_the_proposer_copies_what_followed_the_latest_earlier_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6]
    assert proposer.propose(tokens, 3) == [7, 1, 5]  # "5 6" last seen at 5..6, then 7 1 5
    assert proposer.propose(tokens, 2) == [7, 1]  # no more than the slots
    assert proposer.propose([1, 2, 3, 4], 3) == []  # no earlier match
    assert proposer.propose([4, 4], 3) == [4]  # a 1-gram: all that followed it
    assert num_accepted([3, 4, 5], [3, 4, 9, 0]) == 2 and num_accepted([3], [2, 0]) == 0


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill
    {"num_kv_blocks": 14, "enable_prefix_caching": False},  # preemption
], ids=["plain", "chunked", "preempted"])
def test_greedy_with_speculation_equals_transformers(tiny_llama, prompts, options):
    llm = LLM(str(tiny_llama), speculative_config=SPEC, **options)
    before = llm.stats()
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    assert got == hf_greedy(tiny_llama, prompts, MAX_TOKENS)
    assert accepted_since(llm, before) > 0
    if "num_kv_blocks" in options:
        assert llm.stats().num_preemptions > 0
    assert llm.stats().kv_cache_usage == 0  # every block back


def test_prefix_hits_after_speculation_are_still_exact(tiny_llama, spec_llm, prompts):
    """What the first run cached (prompt and verified output blocks) serves the second."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    longer = [p + out[:40] for p, out in zip(prompts, first)]
    hits_before = spec_llm.stats().prefix_cache_hits
    got = [o.outputs[0].token_ids for o in spec_llm.generate(longer, SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True))]
    assert spec_llm.stats().prefix_cache_hits - hits_before >= 16 * len(prompts)
    assert got == hf_greedy(tiny_llama, longer, 16)


def test_no_draft_is_ever_in_the_prefix_cache(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), speculative_config=SPEC)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert llm.stats().spec_decode_num_draft_tokens > llm.stats().spec_decode_num_accepted_tokens > 0
    manager = llm.scheduler.kv_cache_manager
    size = manager.block_size
    verified = set()
    for prompt, out in zip(prompts, outs):
        tokens, parent = prompt + out.outputs[0].token_ids, None
        for i in range(len(tokens) // size):
            parent = hash_block_tokens(parent, tokens[i * size:(i + 1) * size])
            verified.add(parent)
    cached = set(manager.block_pool._cached)
    assert cached and cached <= verified


def test_seeded_sampling_is_identical_with_and_without_speculation(tiny_llama, spec_llm, prompts):
    plain = LLM(str(tiny_llama))
    # Peaked (a random model is nearly flat), so that some drafts are accepted.
    params = [SamplingParams(temperature=0.05, top_p=0.9, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             presence_penalty=0.3 * (i % 2), logprobs=1) for i in range(len(prompts))]
    expected = plain.generate(prompts, params)
    before = spec_llm.stats()
    # Whatever shares the batch: the same requests, then with others beside them.
    got = spec_llm.generate(prompts, params)
    crowd = spec_llm.generate(prompts + prompts[::-1], params + [SamplingParams(temperature=1.0, max_tokens=20)] * 4)
    for e, g, c in zip(expected, got, crowd):
        assert e.outputs[0].token_ids == g.outputs[0].token_ids == c.outputs[0].token_ids
        assert [next(iter(position)) for position in g.outputs[0].logprobs] == g.outputs[0].token_ids
        assert [g.outputs[0].logprobs[i][t].logprob for i, t in enumerate(g.outputs[0].token_ids)] == pytest.approx(
            [e.outputs[0].logprobs[i][t].logprob for i, t in enumerate(e.outputs[0].token_ids)], abs=1e-4)
    assert accepted_since(spec_llm, before) > 0


def test_penalties_and_min_tokens_apply_at_every_draft_position(tiny_llama, spec_llm):
    """Each draft position is penalized with the history up to it, the drafts before it
    included, and min_tokens counts those drafts: output as without speculation. Two
    tokens biased far above the rest, the first a little more, and a frequency penalty:
    greedy alternates between them, so each draft position's choice turns on the counts
    of the drafts before it; an end-of-sequence biased higher still ends the request
    exactly at min_tokens, wherever that falls inside a verify."""
    plain = LLM(str(tiny_llama))
    a, b, eos = 40, 41, spec_llm.eos_token_id
    prompt = [a, b] * 6  # prompt lookup proposes the alternation
    cases = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.0,
                            logit_bias={a: 30.0, b: 29.5}),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=13, frequency_penalty=1.0,
                            logit_bias={a: 30.0, b: 29.5, eos: 60.0})]
    for params in cases:
        before = spec_llm.stats()
        [got] = spec_llm.generate([prompt], params)
        [expected] = plain.generate([prompt], params)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert accepted_since(spec_llm, before) > 0
    assert len(expected.outputs[0].token_ids) == 14 and expected.outputs[0].finish_reason == "stop"


def test_max_tokens_and_stop_strings_are_exact(tiny_llama, spec_llm, prompts):
    plain = LLM(str(tiny_llama))
    for max_tokens in (1, 2, 5, 17):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
        assert [len(t) for t in got] == [max_tokens] * len(prompts)
        assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    long = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    stops = [o.outputs[0].text[20:24] for o in long]
    for prompt, stop, full in zip(prompts, stops, long):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
        [out] = spec_llm.generate([prompt], params)
        assert out.outputs[0].text == full.outputs[0].text[:full.outputs[0].text.index(stop)]
    assert spec_llm.stats().kv_cache_usage == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_served_with_speculation_equals_offline_without_it_across_a_worker_kill(tiny_llama, tmp_path):
    """`llmbus serve --workers 2 --speculative-config ...`, greedy streams, one worker
    killed once every stream has had 6 steps (drafts accepted on both workers by then):
    each text is the offline one without speculation, and the dead worker's drafts stay
    counted."""
    import asyncio
    import json

    import httpx
    import openai
    import psutil

    from deployment import llmbus_serve
    from llmbus.deploy.serve import live_children

    texts = [f"{t} {i}" for i in range(3) for t in TEXTS]
    plain = LLM(str(tiny_llama))
    expected = [o.outputs[0].text for o in plain.generate(
        texts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    proc, url = llmbus_serve(["--model", str(tiny_llama), "--served-model-name", "tiny", "--workers", "2",
                              "--num-kv-blocks", "256", "--speculative-config", json.dumps(SPEC)],
                             tmp_path / "stderr.log")
    try:
        # Said to serve once both workers joined: the streams are placed 6 and 6 (with one,
        # all 12 went there, more than speculation's batch limit, and the other was killed idle).
        assert httpx.get(url + "/health", timeout=5).json()["workers"] == 2
        victim = live_children(proc.pid, "worker")[0]

        async def stream_all() -> list[str]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            chunks, killed = [0] * len(texts), []

            async def one(i: int, prompt: str) -> str:
                text = ""
                stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    text += chunk.choices[0].text
                    chunks[i] += 1
                    if min(chunks) >= 6 and not killed:
                        # Once: asking is_running() again raced the supervisor reaping it.
                        killed.append(victim.pid)
                        victim.kill()
                return text

            try:
                return await asyncio.gather(*(one(i, p) for i, p in enumerate(texts)))
            finally:
                await client.close()

        assert asyncio.run(stream_all()) == expected
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE  # (not reaped yet)
        metrics = httpx.get(url + "/metrics", timeout=5).text
        accepted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("llmbus:spec_decode_num_accepted_tokens_total{")]
        assert accepted and sum(accepted) > 0
        assert 'llmbus:spec_decode_num_accepted_tokens_per_pos_total{' in metrics
    finally:
        proc.terminate()
        proc.wait(60)


def test_no_drafts_beyond_disable_by_batch_size_and_the_pipeline_fills_again():
    from test_scheduler import make_request, make_scheduler

    from shared.messages import ModelRunnerOutput

    def decoding(num_requests: int):
        scheduler = make_scheduler(num_speculative_tokens=3, speculative_disable_by_batch_size=2)
        for i in range(num_requests):
            scheduler.add_request(make_request(f"r{i}", [1, 2, 3], max_tokens=20))
        prefill = scheduler.schedule()
        scheduler.update_from_output(prefill, ModelRunnerOutput(
            prefill.step_id, list(prefill.num_scheduled_tokens), [[7]] * num_requests))
        return scheduler

    few, many = decoding(2), decoding(3)
    assert not few.may_build_ahead() and many.may_build_ahead()
    step = few.schedule()
    assert step.num_draft_slots == {"r0": 3, "r1": 3} and step.num_scheduled_tokens == {"r0": 4, "r1": 4}
    # Two of r0's three drafts accepted, none of r1's: the rest of the slots are given back.
    few.update_from_output(step, ModelRunnerOutput(step.step_id, ["r0", "r1"], [[8, 9, 10], [5]],
                                                   num_draft_tokens=[3, 1]))
    assert [few.requests[r].num_computed_tokens for r in ("r0", "r1")] == [3 + 1 + 2, 3 + 1]
    assert [few.requests[r].num_tokens for r in ("r0", "r1")] == [3 + 1 + 3, 3 + 1 + 1]
    assert few.make_stats().spec_decode_num_accepted_tokens_per_pos == [1, 1, 0]
    assert many.schedule().num_draft_slots == {}


def test_a_request_whose_drafts_keep_failing_stops_speculating_and_one_whose_drafts_pay_goes_on():
    """Non-repetitive traffic loses nothing: once a request has had SPEC_PROBATION_TOKENS
    drafts and under SPEC_MIN_ACCEPTANCE of them were accepted, it gets no more draft slots
    (each rejected draft costs a row of the forward); a request beside it whose drafts
    are accepted keeps its slots."""
    from test_scheduler import make_request, make_scheduler

    from services.scheduler.core.speculation import SPEC_MIN_ACCEPTANCE, SPEC_PROBATION_TOKENS
    from shared.messages import ModelRunnerOutput

    scheduler = make_scheduler(num_speculative_tokens=4, speculative_disable_by_batch_size=None)
    for rid in ("fails", "pays"):
        scheduler.add_request(make_request(rid, [1, 2, 3], max_tokens=400))
    step = scheduler.schedule()
    scheduler.update_from_output(step, ModelRunnerOutput(step.step_id, list(step.num_scheduled_tokens), [[7], [7]]))
    # "fails" gets one draft in eight accepted (under the minimum), "pays" all of its.
    accepted = {"fails": [1] + [0] * 7, "pays": [4] * 8}
    assert sum(accepted["fails"]) < SPEC_MIN_ACCEPTANCE * 4 * len(accepted["fails"])
    assert 4 * len(accepted["fails"]) == SPEC_PROBATION_TOKENS
    for i in range(len(accepted["fails"])):
        step = scheduler.schedule()
        assert step.num_draft_slots == {"fails": 4, "pays": 4}  # still on probation
        sampled = [[8] * (1 + accepted[rid][i]) for rid in ("fails", "pays")]
        scheduler.update_from_output(step, ModelRunnerOutput(step.step_id, ["fails", "pays"], sampled,
                                                             num_draft_tokens=[4, 4]))
    assert not scheduler.requests["fails"].speculate and scheduler.requests["pays"].speculate
    step = scheduler.schedule()
    assert step.num_draft_slots == {"pays": 4} and step.num_scheduled_tokens["fails"] == 1


def test_unseeded_sampling_keeps_its_distribution(tiny_llama):
    """Drafts accepted while the sample equals them is exact rejection sampling for a
    one-hot draft: the tokens after a verify have the distribution they have without
    speculation (a two-sample chi-square over the first two output tokens)."""
    from scipy.stats import chi2_contingency

    spec = LLM(str(tiny_llama), speculative_config={**SPEC, "prompt_lookup_min": 2, "disable_by_batch_size": None})
    plain = LLM(str(tiny_llama))
    prompt = spec.tokenizer.encode("abc abc abc abc abc abc")  # a cycle of three tokens
    assert len(set(prompt[-3:])) == 3
    # The mass on two of the cycle's tokens, the prompt's last and the one that follows it
    # in the cycle: when that one is sampled first, the prompt's 2-grams propose the
    # third, which the model seldom samples, so accepting a draft it should not would show.
    a, b = prompt[-3], prompt[-1]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logit_bias={a: 6.0, b: 6.0})
    before = spec.stats()
    counts = {}
    for side, llm in (("spec", spec), ("plain", plain)):
        outs = llm.generate([prompt] * 800, params)
        counts[side] = [tuple(o.outputs[0].token_ids[:2]) for o in outs]  # the draft decides the second
    drafted = spec.stats().spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert drafted > 50 and accepted_since(spec, before) < drafted  # verifies decided some of it
    seen = sorted(set(counts["spec"]) | set(counts["plain"]), key=lambda t: -(counts["spec"] + counts["plain"]).count(t))
    # Categories with enough expected counts; the rest pooled.
    common = [t for t in seen if (counts["spec"] + counts["plain"]).count(t) >= 20]
    table = [[c.count(t) for t in common] + [sum(1 for x in c if x not in common)] for c in counts.values()]
    assert len(common) >= 3
    assert chi2_contingency(table).pvalue > 1e-3


def test_seeded_draws_at_every_draft_position_are_the_ones_without_speculation(tiny_llama):
    """At temperature 1 the seeded draw of each position decides the token: the bonus
    position must draw as the position it is, not as the one the step started at."""
    spec = LLM(str(tiny_llama), speculative_config={**SPEC, "disable_by_batch_size": None})
    plain = LLM(str(tiny_llama))
    prompt = spec.tokenizer.encode("abc abc abc abc abc abc")
    bias = {t: 6.0 for t in set(prompt[-3:])}  # on the cycle's tokens: drafts get accepted
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True, logit_bias=bias, n=1 + s % 2)
              for s in range(32)]
    before = spec.stats()
    got = [[c.token_ids for c in o.outputs] for o in spec.generate([prompt] * 32, params)]
    assert got == [[c.token_ids for c in o.outputs] for o in plain.generate([prompt] * 32, params)]
    assert accepted_since(spec, before) > 48


def test_the_step_span_says_how_many_drafts_were_accepted():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.scheduler.step_tracer import StepTracer
    from shared.messages import ModelRunnerOutput

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("test").start_span("scheduler.step")
    StepTracer.end(span, None, ModelRunnerOutput(1, ["a", "b", "c"], [[5, 6, 7], [8], []], num_draft_tokens=[3, 2, 0]))
    [finished] = exporter.get_finished_spans()
    assert (finished.attributes["llmbus.num_draft_tokens"], finished.attributes["llmbus.num_accepted_tokens"]) == (5, 2)


def test_constrained_requests_speculate_within_their_grammar(tiny_llama):
    """Drafts of a constrained request are masked position by position: the output is the
    one without speculation (itself held to transformers + xgrammar elsewhere), valid."""
    import json

    from shared.sampling_params import StructuredOutputsParams
    from test_structured_outputs import SCHEMA, satisfies

    spec = LLM(str(tiny_llama), speculative_config=SPEC)
    plain = LLM(str(tiny_llama))
    example = json.dumps({"color": "green", "ok": True}, separators=(", ", ": "))
    prompts = [spec.tokenizer.encode(f"{example} {example} {example}"),
               spec.tokenizer.encode("123-ab 123-ab 123-ab 123-"), spec.tokenizer.encode("yes no maybe so yes no")]
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
             StructuredOutputsParams(choice=["yes", "no", "maybe so"])]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in specs]
    before = spec.stats()
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [satisfies(kind, o.outputs[0].text) for kind, o in zip(["json", "regex", "choice"], got)] == [True] * 3
    assert [o.outputs[0].finish_reason for o in got] == ["stop"] * 3
    assert accepted_since(spec, before) > 0
