"""End to end over a real nats-server and real service processes, driven by the official
`openai` client (and raw httpx where the SSE bytes themselves matter)."""

import asyncio
import itertools
import json
import re
import time

import httpx
import openai
import pytest

from deployment import Deployment
from llmbus import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

CONTEXT = 1024


@pytest.fixture(scope="module")
def deployment(tiny_llama):
    d = Deployment(
        str(tiny_llama),
        worker_args=["--max-model-len", str(CONTEXT), "--num-kv-blocks", "256"],
        gateway_args=["--max-body-bytes", "20000"],
    )
    try:
        d.wait_healthy()
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=deployment.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=CONTEXT)


PROMPTS = ["The quick brown fox", "Paged attention keeps", "héllo wörld — 東京"]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_completions_equal_the_offline_engine(client, offline):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    for prompt, text in zip(PROMPTS, expected):
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == text
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 12
        assert out.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))


def test_a_batch_of_prompts_and_logit_bias_served_as_offline(client, offline):
    """What LangChain's completions client sends: one request, a list of prompts."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, params)]
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert out.usage.completion_tokens == 3 * 8
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    banned = expected[0].token_ids[0]
    biased = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       logit_bias={str(banned): -100}, extra_body={"ignore_eos": True})
    offline_biased = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                 logit_bias={banned: -100.0}))
    assert biased.choices[0].text == offline_biased[0].outputs[0].text != expected[0].text


def test_bad_words_served_as_offline(client, offline):
    """vLLM's bad_words through the openai client: words the free output has (the gateway
    tokenizes them as LLM does) are avoided, the same tokens as offline; a blank word is a
    400 naming the field."""
    prompt = PROMPTS[0]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    free = offline.generate(prompt, plain)[0].outputs[0]
    words = [offline.tokenizer.decode(free.token_ids[2:4]).strip() or "the", free.text.split()[-1]]
    [want] = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=words))
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, "bad_words": words})
    assert want.outputs[0].token_ids != free.token_ids
    assert out.choices[0].text == want.outputs[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"bad_words": [" "]})
    assert refused.value.body["param"] == "bad_words"


def test_a_cache_salt_keeps_prefix_hits_within_a_tenant(client, offline):
    """vLLM's cache_salt through the openai client: a salted prompt's blocks are found
    again under its salt only (usage's cached_tokens), on completions and chat alike."""
    prompt = "Tenant isolation: " + " ".join(f"w{i}" for i in range(40))
    cacheable = (len(offline.tokenizer.encode(prompt)) - 1) // 16 * 16
    assert cacheable >= 32

    def cached(salt: str | None) -> int:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={} if salt is None else {"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    assert [cached(s) for s in ("t1", "t2", None, "t1", None)] == [0, 0, 0, cacheable, cacheable]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    hits = [client.chat.completions.create(**chat, extra_body={"cache_salt": "t3"}).usage
            .prompt_tokens_details.cached_tokens for _ in range(2)]
    assert hits[0] == 0 and hits[1] >= 32
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**chat, extra_body={"cache_salt": ""})
    assert refused.value.body["param"] == "cache_salt"


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def test_structured_outputs_served_as_offline(client, offline):
    """response_format json_schema through the openai client, and vLLM's structured_outputs
    regex: each output satisfies its spec, ends with stop, and is the offline engine's."""
    import jsonschema

    from shared.sampling_params import StructuredOutputsParams

    messages = [{"role": "user", "content": "A color as JSON"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    [want] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=40,
                                                   structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    assert text == want.outputs[0].text
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    regex = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].text) and regex.choices[0].finish_reason == "stop"


def test_the_responses_api_answers_as_the_offline_chat(client, offline):
    """/v1/responses through the openai client: the offline engine's chat text, whole and
    streamed, a json_schema text format that validates and is the offline engine's, and a
    turn that goes on from a stored response (previous_response_id) as the offline chat
    of the whole conversation."""
    import jsonschema

    from shared.sampling_params import StructuredOutputsParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A color as JSON"}]
    [plain] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12))
    whole = client.responses.create(model="tiny", instructions="Be brief.", input="A color as JSON",
                                    temperature=0, max_output_tokens=12)
    assert whole.output_text == plain.outputs[0].text
    assert whole.usage.output_tokens == len(plain.outputs[0].token_ids)
    events = list(client.responses.create(model="tiny", instructions="Be brief.", input="A color as JSON",
                                          temperature=0, max_output_tokens=12, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.outputs[0].text
    assert events[-1].type == "response.completed" and events[-1].response.output_text == whole.output_text
    fmt = {"format": {"type": "json_schema", "name": "color", "schema": SCHEMA}}
    shaped = client.responses.create(model="tiny", instructions="Be brief.", input="A color as JSON",
                                     temperature=0, max_output_tokens=40, text=fmt)
    jsonschema.validate(json.loads(shaped.output_text), SCHEMA)
    [want] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=40,
                                                   structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    assert shaped.output_text == want.outputs[0].text and shaped.status == "completed"
    more = client.responses.create(model="tiny", previous_response_id=whole.id, input="Another one",
                                   temperature=0, max_output_tokens=12)
    [want] = offline.chat([messages[1], {"role": "assistant", "content": whole.output_text},  # (instructions not carried)
                           {"role": "user", "content": "Another one"}], SamplingParams(temperature=0, max_tokens=12))
    assert more.output_text == want.outputs[0].text
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    with_logprobs = client.responses.create(model="tiny", instructions="Be brief.", input="A color as JSON",
                                            temperature=0, max_output_tokens=12, top_logprobs=2,
                                            include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                          logprobs=True, top_logprobs=2)
    assert [e.model_dump() for e in with_logprobs.output[0].content[0].logprobs] == [
        e.model_dump() for e in chat.choices[0].logprobs.content]


def test_streamed_completion_equals_the_non_streamed_one(client):
    kwargs = dict(model="tiny", prompt="naïve café", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_prompt_as_token_ids_with_echo(client, offline):
    ids = offline.tokenizer.encode("The quick")
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text.startswith("The quick")


def test_echo_with_logprobs_gives_the_prompt_s_logprobs_as_offline(client, offline):
    """OpenAI's echo with logprobs (lm-evaluation-harness scores a continuation so): the
    prompt's tokens first, the first with no logprob, then the completion's; the same
    streamed and not, and the offline engine's (held to transformers, test_prompt_logprobs)."""
    ids = offline.tokenizer.encode(PROMPTS[2])
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2,
                                                 ignore_eos=True), use_tqdm=False)[0]
    entries = ref.prompt_logprobs[1:] + ref.outputs[0].logprobs  # (vLLM's: token id -> Logprob)
    tokens = ids[1:] + ref.outputs[0].token_ids
    kwargs = dict(model="tiny", prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [lp for c in chunks if c.logprobs for lp in zip(c.logprobs.tokens, c.logprobs.token_logprobs)]
    lp = whole.choices[0].logprobs

    def text(token_id: int) -> str:
        return offline.tokenizer.decode([token_id], skip_special_tokens=False)

    assert lp.tokens == [text(t) for t in ids + ref.outputs[0].token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e[t].logprob for t, e in zip(tokens, entries)], abs=1e-4)
    assert [set(top) for top in lp.top_logprobs[1:]] == [{text(t) for t, v in e.items() if v.rank <= 2}
                                                         for e in entries]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs))
    # Offsets into the choice's text: each token where the one before ends, decoded alone.
    assert lp.text_offset == list(itertools.accumulate((len(t) for t in lp.tokens[:-1]), initial=0))
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
    assert whole.choices[0].text == "".join(c.text for c in chunks) == PROMPTS[2] + ref.outputs[0].text


def test_vllm_prompt_logprobs_and_echo_of_the_prompt_alone(deployment, offline):
    """vLLM's prompt_logprobs field: per prompt token (null first) its own logprob and
    rank and the top-k's, by token id, on each completion choice and atop a chat; echo
    with max_tokens 0 gives the prompt alone, scored; prompt_logprobs cannot stream."""
    url, ids = deployment.base_url, offline.tokenizer.encode(PROMPTS[0])
    ref = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)

    choice = post("/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2}).json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    for token_id, entry, expected in zip(ids[1:], choice["prompt_logprobs"][1:], ref.prompt_logprobs[1:]):
        assert list(entry) == [str(t) for t in expected] and list(entry)[0] == str(token_id)  # (the same order)
        for t, want in expected.items():  # (offline's Logprob, served as JSON)
            assert (entry[str(t)]["rank"], entry[str(t)]["decoded_token"]) == (want.rank, want.decoded_token)
            assert entry[str(t)]["logprob"] == pytest.approx(want.logprob, abs=1e-4)
    assert choice["logprobs"] is None  # (no echo: the completion's own were not asked for)
    alone = post("/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    assert alone["choices"][0]["text"] == PROMPTS[0]
    assert alone["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [e[t].logprob for t, e in zip(ids[1:], ref.prompt_logprobs[1:])], abs=1e-4)
    assert len(alone["choices"][0]["logprobs"]["tokens"]) == len(ids)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == len(offline.tokenizer.apply_chat_template(messages))
    streamed = post("/v1/completions", {"prompt": ids, "prompt_logprobs": 1, "stream": True})
    assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "prompt_logprobs")
    assert post("/v1/completions", {"prompt": ids, "max_tokens": 0}).status_code == 400  # without echo


def test_chat_stream_and_non_stream_agree(client, offline):
    messages = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    [expected] = offline.chat(messages, params)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].choices == []


def test_sse_bytes_end_with_done(deployment):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", deployment.base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_stop_string_is_not_shown(client):
    free = client.completions.create(model="tiny", prompt="Continuous", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[4:7]
    out = client.completions.create(model="tiny", prompt="Continuous", max_tokens=20, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == free[: free.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="Continuous", max_tokens=20, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == free[: free.index(stop)]


def test_n_2_gives_two_choices(client):
    out = client.completions.create(model="tiny", prompt="The", max_tokens=8, n=2, temperature=1.0, seed=5,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    assert out.choices[0].text != out.choices[1].text


def test_logprobs_in_completions_and_chat(client, tiny_llama):
    from tokenizers import Tokenizer

    out = client.completions.create(model="tiny", prompt="The", max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20"):  # --max-logprobs
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       logprobs=True, top_logprobs=21)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    # Greedy: the chosen token is the most likely one.
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)
    # vLLM's return_tokens_as_token_ids: the same logprobs, tokens named by id.
    by_id = client.completions.create(model="tiny", prompt="The", max_tokens=4, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = by_id.choices[0].logprobs
    assert ids.token_logprobs == lp.token_logprobs
    token_ids = [int(t.removeprefix("token_id:")) for t in ids.tokens]
    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    assert [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids] == lp.tokens


def test_32_concurrent_streams_all_complete(deployment):
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model="tiny", prompt=f"request {i}", max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return finish, usage.completion_tokens

    async def main():
        aclient = openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    assert results == [("length", 16)] * 32


def test_cancelled_stream_frees_its_blocks(deployment):
    before = deployment.stats()["num_generation_tokens"]
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", deployment.base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        running = deployment.stats()
        lines.close()  # the client goes away mid-stream
    assert running["num_running_reqs"] == 1 and running["kv_cache_usage"] > 0
    for _ in range(100):
        stats = deployment.stats()
        if stats["num_running_reqs"] == 0 and stats["kv_cache_usage"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_running_reqs"] == 0
    assert stats["kv_cache_usage"] == 0
    generated = stats["num_generation_tokens"] - before
    assert generated < 1000  # it was stopped, not run to the end
    time.sleep(0.5)
    assert deployment.stats()["num_generation_tokens"] - before == generated  # and nothing more came


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": CONTEXT}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
        ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
        ({"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
        ({"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "[0-9"}}, 400, "structured_outputs"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
        ({"model": "tiny", "prompt": "x", "priority": 1}, 400, None),  # the scheduler's policy is fcfs
        ({"model": "tiny", "prompt": "x", "allowed_token_ids": [10**6]}, 400, None),  # past the vocabulary
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(deployment, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(deployment.base_url + path, json=body, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    ok = httpx.post(deployment.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_tokenize_and_detokenize_over_the_bus(deployment, offline):
    """Encoded by a tokenizer replica as the engine's prompts are."""
    url, messages = deployment.base_url, [{"role": "user", "content": "héllo wörld"}]
    chat = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=30).json()
    prompt = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[2]}, timeout=30).json()
    assert chat["tokens"] == offline.tokenizer.apply_chat_template(messages)
    assert prompt == {"count": len(offline.tokenizer.encode(PROMPTS[2])), "max_model_len": CONTEXT,
                      "tokens": offline.tokenizer.encode(PROMPTS[2]), "token_strs": None}
    text = httpx.post(url + "/detokenize", json={"tokens": prompt["tokens"]}, timeout=30).json()
    assert text == {"prompt": PROMPTS[2]}
    started = [*messages, {"role": "assistant", "content": "Bonjour"}]
    continued = httpx.post(url + "/tokenize", json={"messages": started, "add_generation_prompt": False,
                                                    "continue_final_message": True}, timeout=30).json()
    assert continued["tokens"] == offline.tokenizer.apply_chat_template(started, False, continue_final_message=True)
    assert offline.tokenizer.decode(continued["tokens"], skip_special_tokens=False).endswith("Bonjour")
    bad = httpx.post(url + "/tokenize", json={"messages": [{"role": "user"}]}, timeout=30)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "messages"), bad.text


def test_context_error_gives_both_numbers(deployment):
    resp = httpx.post(deployment.base_url + "/v1/completions",
                      json={"model": "tiny", "prompt": "hello", "max_tokens": CONTEXT}, timeout=30)
    message = resp.json()["error"]["message"]
    assert str(CONTEXT) in message and "prompt has" in message


def test_malformed_json_and_oversized_body(deployment):
    resp = httpx.post(deployment.base_url + "/v1/completions", content=b"{not json", timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(deployment.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 30000}, timeout=30)
    assert resp.status_code == 413


def test_api_key_is_required_when_set(deployment, tmp_path):
    import signal

    key_file = tmp_path / "keys"
    key_file.write_text("from-file\n")
    url = deployment.start_gateway("gateway-with-key", "--api-key", "s3cret", "--api-key-file", str(key_file),
                                   "--metrics-require-key")
    deployment.wait_healthy(url)  # /health stays open
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    for key in ("s3cret", "from-file"):
        keyed = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        assert keyed.completions.create(**body).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(**body)
    # SIGHUP reads the file again: its new key works, the one it no longer has does not.
    key_file.write_text("rotated\n")
    deployment.procs["gateway-with-key"].send_signal(signal.SIGHUP)

    def status(key: str) -> int:
        return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          timeout=30).status_code

    deadline = time.monotonic() + 10
    while status("rotated") != 200:
        assert time.monotonic() < deadline, "the rotated key was not taken"
        time.sleep(0.1)
    assert (status("from-file"), status("s3cret")) == (401, 200)
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer rotated"}, timeout=30).status_code == 200


def test_a_conversation_goes_on_at_another_gateway(deployment, client, offline):
    """Two `llmbus gateway` replicas, as behind a balancer: a response stored by one is
    gone on from (previous_response_id), read and deleted at the other (the store asked
    over the bus), and the turn is the offline chat of the whole conversation."""
    url = deployment.start_gateway("gateway-2")
    deployment.wait_healthy(url)
    other = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(model="tiny", input="A color?", temperature=0, max_output_tokens=8)
    time.sleep(1.0)  # (the new gateway hears the first one's heartbeat, twice a second)
    more = other.responses.create(model="tiny", previous_response_id=first.id, input="Another one",
                                  temperature=0, max_output_tokens=8)
    [want] = offline.chat([{"role": "user", "content": "A color?"}, {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "Another one"}], SamplingParams(temperature=0, max_tokens=8))
    assert more.output_text == want.outputs[0].text
    assert other.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert client.responses.retrieve(more.id).id == more.id  # (and the other way round)
    other.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_gateway_behind_a_proxys_prefix_says_so_in_its_docs(deployment):
    """vLLM's --root-path (uvicorn's): a proxy serves the API under /api and strips it; the
    API description's URLs carry it, the routes answer as before."""
    url = deployment.start_gateway("gateway-root", "--root-path", "/api")
    deployment.wait_healthy(url)
    assert httpx.get(url + "/openapi.json", timeout=30).json()["servers"] == [{"url": "/api"}]
    assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "tiny"


def test_tokenizer_answers_bad_messages_with_errors_not_timeouts(deployment):
    import msgspec
    import nats

    from shared.bus import Subjects, encode
    from shared.messages import TokenizeRequest, TokenizeResponse

    async def ask(payload: bytes) -> TokenizeResponse:
        nc = await nats.connect(deployment.nats.url)
        try:
            reply = await nc.request(Subjects("tiny").tokenize, payload, timeout=10)
            return msgspec.msgpack.decode(reply.data, type=TokenizeResponse)
        finally:
            await nc.close()

    malformed = asyncio.run(ask(b"\xc1 not msgpack"))
    assert malformed.error and "malformed" in malformed.error
    neither = asyncio.run(ask(encode(TokenizeRequest())))
    assert neither.error == "give exactly one of prompt and messages"
    ok = asyncio.run(ask(encode(TokenizeRequest(prompt="hello"))))
    assert ok.error is None and ok.token_ids


def test_each_stream_chunk_carries_one_entry_per_choice_and_every_logprob(deployment):
    body = {"model": "tiny", "prompt": "naïve café", "max_tokens": 40, "n": 2, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}
    with httpx.stream("POST", deployment.base_url + "/v1/completions", json=body, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    tokens = {0: 0, 1: 0}
    for chunk in chunks:
        indices = [c["index"] for c in chunk["choices"]]
        assert len(indices) == len(set(indices))
        for c in chunk["choices"]:
            tokens[c["index"]] += len((c["logprobs"] or {}).get("tokens", []))
    assert tokens == {0: 40, 1: 40}


def test_use_beam_search_answers_the_offline_search_s_beams(client, offline):
    """vLLM's use_beam_search: the n best beams as choices, the same as LLM.beam_search's
    (texts after the prompt, an ending EOS not shown), on both endpoints; the fields a beam
    search does not take are 400s naming them, as is length_penalty without it."""
    from llmbus import BeamSearchParams, TokensPrompt

    ids = offline.tokenizer.encode(PROMPTS[0])
    want = offline.beam_search([TokensPrompt(prompt_token_ids=ids)],
                               BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.8))[0].sequences
    texts = [offline.tokenizer.decode([t for t in b.tokens[len(ids):] if t != offline.eos_token_id]) for b in want]
    # temperature 0 as BeamSearchParams' default: at OpenAI's default of 1 each step samples
    # a token too, and a sampled token outside the top 2n joins the candidates (as in vLLM),
    # so the served beams would differ from the offline ones now and then.
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=5, n=3, temperature=0,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.8, "request_id": "b1"})
    assert [c.text for c in out.choices] == texts and out.id == "cmpl-b1"  # (named as any answer is)
    assert [c.finish_reason for c in out.choices] == [b.finish_reason for b in want]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == sum(len(b.tokens) - len(ids) for b in want)
    # A batch of prompts: each its own search, its beams its share of every step's batch
    pair = [ids, offline.tokenizer.encode(PROMPTS[1])]
    each = offline.beam_search([TokensPrompt(prompt_token_ids=p) for p in pair], BeamSearchParams(beam_width=2,
                                                                                                 max_tokens=4))
    batch = client.completions.create(model="tiny", prompt=pair, max_tokens=4, n=2, temperature=0,
                                      extra_body={"use_beam_search": True})
    assert [c.text for c in batch.choices] == [
        offline.tokenizer.decode([t for t in b.tokens[len(p):] if t != offline.eos_token_id])
        for p, out in zip(pair, each) for b in out.sequences]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=2, temperature=0, extra_body={"use_beam_search": True})
    prompt = offline.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    beams = offline.beam_search([TokensPrompt(prompt_token_ids=prompt)], BeamSearchParams(beam_width=2, max_tokens=4))
    assert [c.message.content for c in chat.choices] == [
        offline.tokenizer.decode([t for t in b.tokens[len(prompt):] if t != offline.eos_token_id])
        for b in beams[0].sequences]
    with pytest.raises(openai.BadRequestError, match="n=11 asks each step for 22") as info:  # (--max-logprobs 20)
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=11, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "n"
    for extra, param in (({"use_beam_search": True, "top_p": 0.5}, "top_p"),
                         ({"use_beam_search": True, "stream": True}, "stream"),
                         ({"length_penalty": 2.0}, "length_penalty")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param
