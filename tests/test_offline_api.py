"""The offline `LLM` API: text in, text out, and bad input that is refused cleanly."""

import asyncio
import os
import signal
import time

import msgspec
import pytest

from llmbus import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256)


def test_generate_from_text_returns_text_and_token_ids(llm):
    [out] = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    completion = out.outputs[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    assert len(completion.token_ids) == 8
    assert completion.finish_reason == "length"
    assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_step_adds_tokens_as_they_come_and_the_text_with_the_finish(llm):
    """The text is decoded once a completion is over; only a request with stop strings,
    which must be looked for in it, has its text grow step by step."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [reference] = llm.generate("naïve café", params)
    stop = next(c for c in "~^`|@#" if c not in reference.outputs[0].text)  # (one character: none held back)
    plain, stopped = llm.add_requests(["naïve café"] * 2, [params, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])])
    partial = []
    while not stopped.finished:
        llm.step()
        if not plain.finished and plain.outputs[0].token_ids:
            partial.append((plain.outputs[0].text, stopped.outputs[0].text))
    assert len(partial) > 2
    assert all(text == "" for text, _ in partial) and partial[-1][1]
    for out in (plain, stopped):
        assert out.finished and out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert out.outputs[0].text == reference.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_final_only_outputs_hand_every_token_over_once_when_the_request_finishes(llm):
    """vLLM's RequestOutputKind.FINAL_ONLY (generate's): no step hands over a token before
    the request finishes, and then its tokens, logprobs, prompt logprobs and finish are the
    ones it gets step by step (CUMULATIVE); a request with stop strings, which must be
    looked for in the text as it grows, still gets its tokens step by step."""
    from llmbus import RequestOutputKind

    prompts = [[9, 10, 11], [5, 6, 7, 8], [40, 41]]
    free = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_at = free.outputs[0].token_ids[6]
    params = [SamplingParams(temperature=0, max_tokens=9, logprobs=2, prompt_logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=7, stop=["\x00never"])]

    def run(kind):
        results = llm.add_requests(prompts, [msgspec.structs.replace(p, output_kind=kind) for p in params])
        partial = {0: [], 1: [], 2: []}  # each request's token counts after steps it did not finish in
        while not all(r.finished for r in results):
            llm.step()
            for i, r in enumerate(results):
                if not r.finished:
                    partial[i].append(len(r.outputs[0].token_ids))
        return results, partial

    step_by_step, counts = run(RequestOutputKind.CUMULATIVE)
    held, held_counts = run(RequestOutputKind.FINAL_ONLY)
    assert max(counts[0]) > 0 and max(counts[1]) > 0  # (step by step, tokens came before the end)
    assert held_counts[0] and held_counts[1] and max(held_counts[0] + held_counts[1]) == 0
    assert max(held_counts[2]) > 0  # the request with a stop string: step by step
    for a, b in zip(step_by_step, held):
        assert (a.outputs[0].token_ids, a.outputs[0].text, a.outputs[0].finish_reason, a.outputs[0].stop_reason) == (
            b.outputs[0].token_ids, b.outputs[0].text, b.outputs[0].finish_reason, b.outputs[0].stop_reason)
        assert a.outputs[0].logprobs == b.outputs[0].logprobs and a.prompt_logprobs == b.prompt_logprobs
    assert held[0].outputs[0].logprobs and len(held[0].outputs[0].logprobs) == 9 and held[0].prompt_logprobs
    assert held[1].outputs[0].finish_reason == "stop" and held[1].outputs[0].token_ids[-1] == stop_at


def test_delta_outputs_are_refused_offline_by_name(llm):
    from llmbus import RequestOutputKind

    with pytest.raises(ValueError, match="output_kind DELTA"):
        llm.add_requests([[5, 6]], [SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA)])
    assert not llm.scheduler.has_unfinished_requests()


def test_ctrl_c_in_generate_stops_its_steps_and_leaves_the_engine_usable(llm, monkeypatch):
    """generate() runs all its steps in one call on the engine's thread: a Ctrl-C (SIGINT
    to the caller, here sent from the engine's thread once a few steps have landed) must
    stop them there too, not leave that thread generating to the end."""
    process = llm._process
    landed = []

    def interrupting(outputs):
        landed.append(len(outputs))
        if len(landed) == 4:
            os.kill(os.getpid(), signal.SIGINT)
            # Time for the caller's thread to take it before the next step (a busy machine
            # may not run that thread at once); a stop never set lets the steps run to the end.
            time.sleep(0.5)
        return process(outputs)

    monkeypatch.setattr(llm, "_process", interrupting)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[4, 5, 6], [7, 8]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert llm.executor.call(len, landed) < 10  # (waits for the engine's thread: it stopped)
    assert llm.scheduler.has_unfinished_requests()
    monkeypatch.undo()
    while llm.scheduler.has_unfinished_requests():  # what the interrupted call left, for the tests after
        llm.step()
    [after] = llm.generate([4, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(after.outputs[0].token_ids) == 4


def test_generate_works_from_code_that_already_runs_an_event_loop(llm):
    """As in a notebook: the engine's own loop then runs on a helper thread."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [expected] = llm.generate([5, 6, 7], params)

    async def notebook_cell():
        return llm.generate([5, 6, 7], params)

    [inside] = asyncio.run(notebook_cell())
    assert inside.outputs[0].token_ids == expected.outputs[0].token_ids


def test_offline_runs_two_steps_in_flight_and_leaves_none_when_idle(llm):
    assert llm.engine.max_steps_in_flight == 2
    llm.generate([[4, 5, 6], [7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert llm.engine.num_in_flight == 0 and not llm.engine.busy()
    assert llm.runner.requests == {}


def test_prompt_dicts_as_vllm_s_with_a_cache_salt_per_tenant(llm):
    """vLLM's TextPrompt/TokensPrompt: the same completion as the bare prompt; a prompt's
    cached blocks serve only prompts with its salt; keys llmbus lacks are refused by name."""
    from llmbus import TextPrompt, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [(7 * i + 3) % 384 for i in range(40)]  # two full blocks of 16 to share, used nowhere else here
    [bare] = llm.generate(ids, params)
    [as_text] = llm.generate(TextPrompt(prompt="naïve tenants"), params)
    assert as_text.prompt_token_ids == llm.tokenizer.encode("naïve tenants")
    salted = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=s) for s in ("t1", "t2")], params)
    again = llm.generate([{"prompt_token_ids": ids, "cache_salt": "t1"}, ids], params)
    assert [o.num_cached_tokens for o in (bare, *salted, *again)] == [0, 0, 0, 32, 32]
    assert all(o.outputs[0].token_ids == bare.outputs[0].token_ids for o in (*salted, *again))
    with pytest.raises(TypeError, match="multi_modal_data"):
        llm.generate({"prompt": "a cat", "multi_modal_data": {"image": None}}, params)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": "a cat", "cache_salt": ""}, params)


def test_vllm_s_constructor_options_seed_and_one_device(tiny_llama):
    """LLM(seed=...): unseeded requests sample the same tokens in another LLM with that
    seed, other ones with another; vLLM's trust_remote_code and a parallelism of one are
    taken, more is refused before anything loads."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        llm = LLM(str(tiny_llama), max_model_len=256, seed=seed, trust_remote_code=True, tensor_parallel_size=1,
                  swap_space=4, tokenizer_mode="auto", data_parallel_size=1)
        return [o.outputs[0].token_ids for o in llm.generate(["naïve café", "The quick brown fox"] * 2, params)]

    first = run(7)
    assert first == run(7) and first != run(8)
    assert first[0] != first[2]  # (a seed for the engine, not one per request)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        LLM("no/such-model", pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        LLM("no/such-model", data_parallel_size=2)
    with pytest.raises(ValueError, match="tokenizer_mode='slow'"):
        LLM("no/such-model", tokenizer_mode="slow")


def test_chat_renders_the_template(llm):
    [out] = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4))
    expected = llm.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", False)
    assert out.prompt_token_ids == expected
    assert out.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"  # (vLLM's: the rendered text)
    # vLLM's chat_template: this call's own template in place of the model's
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %} [assistant]"
    [own] = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4),
                     chat_template=template)
    assert own.prompt_token_ids == llm.tokenizer.encode("[user] hello [assistant]", False)


def test_chat_takes_tools_and_text_parts_as_the_served_chat(tiny_llama):
    """vLLM's LLM.chat(tools=...): the tools in the prompt as the served chat puts them
    (this template has none of its own: the hermes system prompt); content as text parts
    is one string, joined by newlines as vLLM's; a part that is not text is refused; and
    get_tokenizer() is the tokenizer that renders it."""
    from services.gateway.engine_params import validate_messages

    llm = LLM(str(tiny_llama), max_model_len=1024)  # (the tools' system prompt is ~450 tokens)
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": weather}}]
    asked = [{"role": "user", "content": "weather in Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    [out] = llm.chat(asked, params, tools=tools)
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(asked, tools=tools)
    assert "get_weather" in llm.tokenizer.decode(out.prompt_token_ids) and len(out.prompt_token_ids) > len(
        llm.chat(asked, params)[0].prompt_token_ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "in Paris?"}]}]
    [joined] = llm.chat(parts, params)
    assert joined.prompt_token_ids == llm.chat([{"role": "user", "content": "weather\nin Paris?"}],
                                               params)[0].prompt_token_ids
    assert validate_messages(parts) == [{"role": "user", "content": "weather\nin Paris?"}]  # (served: the same)
    assert parts[0]["content"][0] == {"type": "text", "text": "weather"}  # (the caller's messages untouched)
    with pytest.raises(ValueError, match="must be a data: or http"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], params)
    text = llm.get_tokenizer().apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.encode(text, add_special_tokens=False) == llm.chat(asked, params)[0].prompt_token_ids


def test_reset_prefix_cache_makes_the_next_prompt_compute_from_scratch(llm):
    prompt = "The prefix cache keeps the blocks of this prompt for the next one that shares them, " * 4
    params = SamplingParams(temperature=0, max_tokens=4)
    first, again = llm.generate([prompt], params), llm.generate([prompt], params)
    assert again[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    [cold] = llm.generate([prompt], params)
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first[0].outputs[0].token_ids


def test_chat_goes_on_from_a_final_assistant_message(llm):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi, I am"}]
    params = SamplingParams(temperature=0, max_tokens=4)
    [out] = llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True)
    expected = llm.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nHi, I am", False)
    assert out.prompt_token_ids == expected
    with pytest.raises(ValueError, match="add_generation_prompt must be false"):
        llm.chat(messages, params, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot set tools"):
        llm.chat(messages, params, chat_template_kwargs={"tools": []})


def test_n_samples_per_prompt_with_seed_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate("naïve café", params)[0]
    again = llm.generate("naïve café", params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_stop_token_ids_and_max_tokens_finish_reasons(llm):
    [free] = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    stop_at = free.outputs[0].token_ids[3]
    first_index = free.outputs[0].token_ids.index(stop_at)
    [out] = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], ignore_eos=True))
    assert out.outputs[0].token_ids == free.outputs[0].token_ids[: first_index + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_at


def test_stop_string_cuts_the_text_before_it(llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    [free] = llm.generate("Paged attention", params)
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    [out] = llm.generate("Paged attention", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    assert out.outputs[0].text == text[: text.index(stop)]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop


def test_logprobs_are_returned_per_token_in_vllms_shape(llm):
    """vLLM's: per generated token, token id -> Logprob(logprob, rank, decoded_token), the
    sampled token first; the top-k after it, one entry for a token that is both."""
    [out] = llm.generate([9, 10, 11], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert next(iter(position)) == token_id and len(position) == 3  # greedy: the top token, one entry
        assert [lp.rank for lp in position.values()] == [1, 2, 3]
        values = [lp.logprob for lp in position.values()]
        assert values == sorted(values, reverse=True)
        assert all(lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
                   for t, lp in position.items())
    assert completion.cumulative_logprob == pytest.approx(
        sum(position[t].logprob for t, position in zip(completion.token_ids, completion.logprobs)))
    # Sampled past the top-k: its own entry first, with its rank, then the k
    [out] = llm.generate([9, 10, 11], SamplingParams(temperature=1.0, seed=0, max_tokens=30, logprobs=1,
                                                     ignore_eos=True))
    outside = [(t, p) for t, p in zip(out.outputs[0].token_ids, out.outputs[0].logprobs) if p[t].rank > 1]
    assert outside  # (the tiny random model's flat distributions: most draws are not its top token)
    for token_id, position in outside:
        assert list(position)[0] == token_id and len(position) == 2
        assert [lp.rank for lp in position.values()][1] == 1 and position[token_id].logprob < max(
            lp.logprob for lp in position.values())


@pytest.mark.parametrize(
    "make_params, name",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_parameter(make_params, name):
    with pytest.raises(ValueError, match=name):
        make_params()


def test_prompt_longer_than_context_is_refused_without_disturbing_others(llm):
    good = [1, 2, 3]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [expected] = llm.generate(good, params)
    with pytest.raises(ValueError, match="context"):
        llm.generate([good, [7] * 300], params)
    # Nothing of the refused call is left behind, and the engine still serves.
    assert not llm.scheduler.has_unfinished_requests()
    [again] = llm.generate(good, params)
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids


def test_bad_request_mid_batch_does_not_disturb_running_requests(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = llm.generate([4, 5, 6], params)
    # Queue a request, run a few steps, then submit a bad one: the first is unaffected.
    llm.add_requests([[4, 5, 6]], [params])
    llm.step()
    llm.step()
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[4, 5, 10**6]], params)
    while llm.scheduler.has_unfinished_requests():
        llm.step()
    pool = llm.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert expected.outputs[0].token_ids  # reference ran


def test_unknown_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_without_chunked_prefill_the_context_is_the_step_budget_as_served(tiny_llama):
    """`LLM(enable_chunked_prefill=False)` caps a context nobody asked for at one step's
    budget, as `llmbus serve --no-enable-chunked-prefill` does (one rule:
    shared.config.scheduler_context); a context asked for past the budget is refused."""
    from shared.config import scheduler_context

    llm = LLM(str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=48)
    assert llm.max_model_len == 48 == scheduler_context(None, 4096, 48, False)
    out = llm.generate([list(range(1, 40))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="must cover max_model_len"):
        LLM(str(tiny_llama), enable_chunked_prefill=False, max_num_batched_tokens=48, max_model_len=64)
