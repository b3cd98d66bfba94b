"""The gateway in process, over a fake engine client: what a client reads for scripted
engine outputs (JSON and SSE alike), and every engine refusal in OpenAI's error shape."""

from __future__ import annotations

import importlib.metadata
import json

import msgspec
import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.tokenizer.shell.service import tokenize
from services.tokenizer.tokenizer import Tokenizer
from shared.config import GatewayConfig
from shared.messages import EngineCoreOutput, FinishReason, SchedulerInfo, SchedulerStats

SCRIPT = "héllo wörld — naïve café and more words after it"


class FakeEngine:
    """Answers each submitted request with SCRIPT's tokens (up to max_tokens), or ends it
    with `finish` at once."""

    reply_subject = "llmbus.tiny.outputs.test"
    max_model_len = 256
    max_lora_rank = 16  # the fleet's, as --max-lora-rank's default
    script = SCRIPT  # what every request is answered with

    def __init__(self, tokenizer: Tokenizer, finish: FinishReason | None = None) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self.queues = {}
        self.submitted = []
        self.aborted = []

    async def tokenize(self, request, headers=None, attempts=3, timeout_s=None) -> list[int]:
        return tokenize(self.tokenizer, request).token_ids

    async def scheduler_info(self, max_age_s: float = 2.0) -> SchedulerInfo:
        return SchedulerInfo("s1", "tiny", 1, self.max_model_len, SchedulerStats(num_running_reqs=len(self.queues)),
                             max_lora_rank=self.max_lora_rank)

    def scheduler_silent(self) -> bool:
        return False

    def open(self, request_ids, queue) -> None:
        self.queues.update(dict.fromkeys(request_ids, queue))

    def close(self, request_ids) -> None:
        for request_id in request_ids:
            self.queues.pop(request_id, None)

    def abort_soon(self, request_ids) -> None:
        self.aborted += request_ids

    async def submit(self, request) -> None:
        self.submitted.append(request)
        queue = self.queues[request.request_id]
        if self.finish is not None:
            queue.put_nowait(EngineCoreOutput(request.request_id, [], self.finish, error=f"scripted {self.finish}"))
            return
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)[: request.sampling_params.max_tokens]
        # An embedding request's vector: a unit one, told apart by its prompt's length.
        pooled = [1.0, float(len(request.prompt_token_ids))] if request.sampling_params.embed else None
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            queue.put_nowait(EngineCoreOutput(request.request_id, [token_id], FinishReason.LENGTH if last else None,
                                              pooled=pooled if i == 0 else None))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer(tiny_llama)


@pytest.fixture(scope="module")
def bos_tokenizer(tiny_llama, tmp_path_factory):
    """The tiny tokenizer, made to begin each encoding with its BOS token as Llama's does."""
    import shutil

    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    folder = tmp_path_factory.mktemp("bos") / "tok"
    shutil.copytree(tiny_llama, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    bos = Tokenizer(tiny_llama).hf.bos_token
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))])
    backend.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def gateway(tokenizer, finish=None, engine_class=FakeEngine,
            config: GatewayConfig | None = None) -> tuple[TestClient, FakeEngine]:
    engine = engine_class(tokenizer, finish)

    async def factory(on_stats):
        return engine

    return TestClient(create_app(factory, tokenizer, config or GatewayConfig("tiny"))), engine


def sse_events(resp) -> list:
    lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_a_completion_is_the_engine_s_tokens_as_text(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 64}).json()
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert body["choices"][0]["text"] == SCRIPT
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(tokenizer.encode("hi")), "completion_tokens": len(ids),
                             "total_tokens": len(tokenizer.encode("hi")) + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # always there: clients read it
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert engine.aborted == []


def test_a_streamed_chat_reads_as_the_whole_answer(tokenizer):
    client, _ = gateway(tokenizer)
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    with client:
        whole = client.post("/v1/chat/completions", json=request).json()
        with client.stream("POST", "/v1/chat/completions",
                           json={**request, "stream": True, "stream_options": {"include_usage": True}}) as resp:
            events = sse_events(resp)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert streamed == whole["choices"][0]["message"]["content"] == SCRIPT
    assert [e["usage"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["usage"] == whole["usage"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_a_stream_is_one_line_an_event_to_a_reader_that_splits_at_unicode_line_breaks(tiny_llama):
    """Text with U+2028, U+2029 and U+0085 (valid raw in JSON) streamed: read with httpx's
    iter_lines, which splits at them as str.splitlines() does (as httpx-sse and our own
    bench read), every event is still whole JSON, and the text comes back as it was."""
    from test_responses_api import serve

    script = "one\u2028two\u2029three\x85four"
    test_client, _, _, _ = serve(tiny_llama, script)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    with test_client:
        for path, body, text_of in (
                ("/v1/completions", {"prompt": "hi", "max_tokens": 64},
                 lambda e: e["choices"][0]["text"] if e["choices"] else ""),
                ("/v1/chat/completions", chat,
                 lambda e: e["choices"][0]["delta"].get("content") or "" if e["choices"] else ""),
                ("/v1/responses", {"input": "hi"},
                 lambda e: e["delta"] if e["type"] == "response.output_text.delta" else "")):
            with test_client.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as resp:
                lines = [line for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
            assert "".join(text_of(json.loads(line[len("data: "):])) for line in lines) == script, path


def test_a_stop_string_cuts_the_text_and_aborts_the_engine_request(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 64,
                                                    "stop": ["naïve"]}).json()
    assert body["choices"][0]["text"] == SCRIPT[: SCRIPT.index("naïve")]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == "naïve"  # vLLM's: which stop string ended it
    assert engine.aborted == [engine.submitted[0].request_id]


def test_include_stop_str_in_output_keeps_the_stop_string_streamed_and_not(tokenizer):
    client, _ = gateway(tokenizer)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 64, "stop": ["naïve", "zzz"],
            "include_stop_str_in_output": True}
    with client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            streamed = "".join(e["choices"][0]["text"] for e in sse_events(resp) if e["choices"])
    expected = SCRIPT[: SCRIPT.index("naïve") + len("naïve")]
    assert (whole["text"], whole["finish_reason"], streamed) == (expected, "stop", expected)


def test_n_choices_are_seeded_apart(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 2,
                                                    "seed": 9}).json()
    assert [r.sampling_params.seed for r in engine.submitted] == [9, 10]
    assert [c["index"] for c in body["choices"]] == [0, 1]


@pytest.mark.parametrize("finish, status, kind", [
    (FinishReason.REJECTED, 400, "invalid_request_error"),
    (FinishReason.OVERLOADED, 429, "rate_limit_exceeded"),
    (FinishReason.ERROR, 500, "internal_error"),
    (FinishReason.UNAVAILABLE, 503, "service_unavailable"),
])
def test_an_engine_refusal_is_the_same_error_in_json_and_before_a_stream(tokenizer, finish, status, kind):
    client, _ = gateway(tokenizer, finish)
    with client:
        for stream in (False, True):
            resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": stream})
            assert resp.status_code == status
            assert resp.json()["error"] == {"message": f"scripted {finish}", "type": kind, "param": None,
                                            "code": status}
            assert (resp.headers.get("retry-after") == "1") == (status == 429)


def test_bad_input_is_refused_before_the_engine(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        missing = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        too_long = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 300})
        not_json = client.post("/v1/completions", content=b"{nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
    assert engine.submitted == []


@pytest.mark.parametrize("field", ["tools", "tool_choice", "suffix", "no_such_field"])
def test_a_field_llmbus_does_not_implement_is_a_400_naming_it(tokenizer, field):
    client, engine = gateway(tokenizer)
    with client:
        resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", field: {"type": "json_object"}})
        bookkeeping = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                           "user": "u1", "metadata": {"k": "v"}, "store": False,
                                                           "service_tier": "auto", "safety_identifier": "s1",
                                                           "prompt_cache_key": "k1",
                                                           # (vLLM's: fast tokenizers decode without it)
                                                           "spaces_between_special_tokens": False})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == field and field in resp.json()["error"]["message"]
    assert bookkeeping.status_code == 200  # OpenAI's bookkeeping changes no output: accepted
    assert len(engine.submitted) == 1


def test_best_of_is_taken_where_it_equals_n_as_vllm_takes_it(tokenizer):
    """SGLang's bench client sends best_of 1; more choices drawn than returned is a 400."""
    client, engine = gateway(tokenizer)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with client:
        one = client.post("/v1/completions", json={**body, "best_of": 1})
        two = client.post("/v1/completions", json={**body, "best_of": 2, "n": 2})
        more = client.post("/v1/completions", json={**body, "best_of": 3, "n": 2})
    assert one.status_code == 200 and two.status_code == 200 and len(two.json()["choices"]) == 2
    assert more.status_code == 400 and more.json()["error"]["param"] == "best_of"
    assert len(engine.submitted) == 1 + 2


# What the peers' benchmark clients send, field for field: vLLM's `vllm bench serve`
# (vllm/benchmarks/lib/endpoint_request_func.py) and NVIDIA's aiperf (its openai_chat and
# openai_completions endpoints, with the extra inputs its users pass).
BENCH_PAYLOADS = {
    "vllm-completions": ("/v1/completions", {
        "model": "tiny", "prompt": "hello there", "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    "vllm-chat": ("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_completion_tokens": 4, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}),
    "aiperf-chat": ("/v1/chat/completions", {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        "model": "tiny", "stream": True, "max_completion_tokens": 4,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True,
        "min_tokens": 4}),
    "aiperf-completions": ("/v1/completions", {
        "prompt": "hello", "model": "tiny", "stream": True, "max_tokens": 4, "stream_options": {"include_usage": True},
        "min_tokens": 4, "ignore_eos": True}),
}


@pytest.mark.parametrize("name", list(BENCH_PAYLOADS))
def test_the_peers_benchmark_clients_payloads_are_taken(tokenizer, name):
    path, body = BENCH_PAYLOADS[name]
    client, engine = gateway(tokenizer)
    with client, client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert events[-1]["usage"]["completion_tokens"] == 4 and len(engine.submitted) == 1


def test_chat_takes_text_as_its_only_modality(tokenizer):
    client, engine = gateway(tokenizer)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with client:
        text = client.post("/v1/chat/completions", json={**chat, "modalities": ["text"]})
        audio = client.post("/v1/chat/completions", json={**chat, "modalities": ["text", "audio"]})
    assert text.status_code == 200
    assert audio.status_code == 400 and audio.json()["error"]["param"] == "modalities"
    assert len(engine.submitted) == 1


def test_logit_bias_reaches_the_engine_as_token_ids(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                  "logit_bias": {"17": -100, "5": 2.5}})
        bad_key = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "logit_bias": {"x": 1}})
        bad_value = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "logit_bias": {"1": 101}})
    assert ok.status_code == 200
    assert engine.submitted[0].sampling_params.logit_bias == {17: -100.0, 5: 2.5}
    assert bad_key.status_code == 400 and bad_key.json()["error"]["param"] == "logit_bias"
    assert bad_value.status_code == 400 and bad_value.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("extra, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}},
     {"json": '{"type":"object"}'}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_json": {"type": "object"}}, {"json": '{"type":"object"}'}),
])
def test_each_way_to_ask_for_structured_output_reaches_the_engine(tokenizer, extra, expected):
    client, engine = gateway(tokenizer)
    with client:
        resp = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                                                         "content": "hi"}], "max_tokens": 2, **extra})
    assert resp.status_code == 200, resp.text
    spec = engine.submitted[0].sampling_params.structured_outputs
    assert (msgspec.structs.asdict(spec) if spec else None) == (
        None if expected is None else {**{"json": None, "json_object": False, "regex": None, "choice": None,
                                          "grammar": None}, **expected})


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"nope": 1}}, "structured_outputs.nope"),
    # (a key vLLM has and llmbus does not implement, beside one it does: never silently dropped)
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_a_malformed_constraint_is_a_400_naming_its_field(tokenizer, extra, param):
    client, engine = gateway(tokenizer)
    with client:
        resp = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **extra})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert engine.submitted == []


def test_health_renders_the_scheduler_s_stats(tokenizer):
    client, _ = gateway(tokenizer)
    with client:
        health = client.get("/health").json()
    assert health["status"] == "ok" and health["workers"] == 1 and health["max_model_len"] == 256
    assert health["stats"]["num_running_reqs"] == 0 and "kv_cache_usage" in health["stats"]


def test_a_batch_of_prompts_is_n_choices_for_each_in_order_with_usage_summed(tokenizer):
    client, engine = gateway(tokenizer)
    prompts = ["hi", [5, 6, 7], "hello there"]
    with client:
        body = client.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 3, "n": 2,
                                                    "echo": True}).json()
        with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 3,
                                                            "n": 2, "stream": True}) as resp:
            events = sse_events(resp)
    script = tokenizer.decode(tokenizer.encode(SCRIPT, add_special_tokens=False)[:3])
    assert [c["index"] for c in body["choices"]] == list(range(6))
    echoes = ["hi", tokenizer.decode([5, 6, 7], skip_special_tokens=False), "hello there"]
    assert [c["text"] for c in body["choices"]] == [e + script for e in echoes for _ in range(2)]
    num_prompt = len(tokenizer.encode("hi")) + 3 + len(tokenizer.encode("hello there"))
    assert body["usage"]["prompt_tokens"] == num_prompt and body["usage"]["completion_tokens"] == 6 * 3
    assert len({r.request_id for r in engine.submitted}) == len(engine.submitted) == 2 * 6  # both requests
    streamed = {}
    for e in events:
        for c in e["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == {i: script for i in range(6)}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_of_n_choices_sends_each_choice_in_its_own_chunk(tokenizer, path):
    """OpenAI's and vLLM's streams carry one choice a chunk; a client that reads each
    chunk's choices[0] (many do) must still see every choice whole: its role, its text,
    its finish reason."""
    chat = path.endswith("chat/completions")
    body = {"model": "tiny", "max_tokens": 5, "n": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi", "echo": True})}
    client, _ = gateway(tokenizer)
    with client:
        with client.stream("POST", path, json=body) as resp:
            events = sse_events(resp)
    script = tokenizer.decode(tokenizer.encode(SCRIPT, add_special_tokens=False)[:5])
    assert all(len(e["choices"]) == 1 for e in events[:-1]) and events[-1]["choices"] == []
    assert all(e["usage"] is not None for e in events)  # (continuous: on every chunk)
    texts, roles, finished = {}, {}, {}
    for e in events[:-1]:
        first = e["choices"][0]
        piece = first["delta"].get("content") or "" if chat else first["text"]
        texts[first["index"]] = texts.get(first["index"], "") + piece
        if chat and "role" in first["delta"]:
            roles[first["index"]] = first["delta"]["role"]
        if first["finish_reason"] is not None:
            finished[first["index"]] = first["finish_reason"]
    assert texts == {i: script if chat else "hi" + script for i in range(3)}
    assert finished == {i: "length" for i in range(3)}
    assert roles == ({i: "assistant" for i in range(3)} if chat else {})


def test_a_bad_prompt_in_a_batch_refuses_the_whole_request(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        resp = client.post("/v1/completions", json={"model": "tiny", "prompt": ["hi", ""], "max_tokens": 3})
        nested = client.post("/v1/completions", json={"model": "tiny", "prompt": [[1, [2]]], "max_tokens": 3})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert nested.status_code == 400
    assert engine.submitted == []


def test_any_of_several_api_keys_opens_v1_and_metrics_can_be_guarded_too(tokenizer):
    engine = FakeEngine(tokenizer)

    async def factory(on_stats):
        return engine

    config = GatewayConfig("tiny", api_keys=("k-one", "k-two"), metrics_require_key=True)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with TestClient(create_app(factory, tokenizer, config)) as client:
        def status(path="/v1/completions", key=None, scheme="Bearer"):
            headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
            if path == "/v1/completions":
                return client.post(path, json=body, headers=headers).status_code
            return client.get(path, headers=headers).status_code

        assert [status(key=k) for k in (None, "", "k-on", "k-one-", "k-one", "k-two")] == [401] * 4 + [200] * 2
        assert status(key="k-one", scheme="bearer") == 200 and status(key="k-one", scheme="Basic") == 401
        assert (status("/metrics"), status("/metrics", "k-two")) == (401, 200)
        assert status("/health") == 200  # stays open for probes
        tokenize = {"model": "tiny", "prompt": "hi"}
        assert [client.post(path, json=tokenize if path == "/tokenize" else {"tokens": [1]}, headers=headers).status_code
                for path in ("/tokenize", "/detokenize")
                for headers in ({}, {"Authorization": "Bearer k-two"})] == [401, 200, 401, 200]
        # vLLM's score and rerank paths outside /v1 embed for the caller too
        assert {client.post(path, json={}).status_code
                for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")} == {401}
        assert client.post("/v1/completions", json=body).json()["error"]["type"] == "authentication_error"
    # Behind --root-path /api, a request sent with the prefix (past the proxy) is routed to
    # the same endpoint, and guarded as it is
    with TestClient(create_app(factory, tokenizer, config), root_path="/api") as client:
        assert client.post("/api/v1/completions", json=body).status_code == 401
        assert client.post("/api/v1/completions", json=body, headers={"Authorization": "Bearer k-one"}).status_code == 200
        assert client.get("/api/metrics").status_code == 401


def test_the_key_file_is_read_again_and_a_bad_reload_keeps_the_keys(tmp_path):
    from services.gateway.api_keys import ApiKeys

    path = tmp_path / "keys"
    path.write_text("# one per line\nfirst\n\n  second  \n")
    keys = ApiKeys(("flag-key",), str(path))
    assert [keys.accepts(f"Bearer {k}") for k in ("first", "second", "flag-key", "third", "# one per line")] == [
        True, True, True, False, False]
    path.write_text("third\n")
    keys.reload()
    assert [keys.accepts(f"Bearer {k}") for k in ("first", "third", "flag-key")] == [False, True, True]
    path.unlink()
    keys.reload()  # unreadable: the keys before stay
    assert keys.accepts("Bearer third")


def test_tokenize_gives_the_ids_a_completion_of_the_prompt_gets(bos_tokenizer):
    tokenizer = bos_tokenizer
    client, engine = gateway(tokenizer)
    with client:
        client.post("/v1/completions", json={"model": "tiny", "prompt": SCRIPT, "max_tokens": 1})
        body = client.post("/tokenize", json={"model": "tiny", "prompt": SCRIPT}).json()
        bare = client.post("/tokenize", json={"prompt": SCRIPT, "add_special_tokens": False,
                                              "return_token_strs": True}).json()  # model may be left out
    ids = engine.submitted[0].prompt_token_ids
    assert body == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    assert ids[0] == tokenizer.hf.bos_token_id and bare["tokens"] == ids[1:]
    assert bare["token_strs"] == tokenizer.hf.convert_ids_to_tokens(ids[1:])


def test_a_completion_s_add_special_tokens_reaches_its_encoding_and_a_chat_s_true_is_a_400(bos_tokenizer):
    """vLLM's add_special_tokens: a completion's text prompt without its BOS when false; a
    chat's template adds what it wants, so true there is refused (as at /tokenize)."""
    client, engine = gateway(bos_tokenizer)
    with client:
        for flag in (True, False):
            client.post("/v1/completions", json={"model": "tiny", "prompt": SCRIPT, "max_tokens": 1,
                                                 "add_special_tokens": flag})
        chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                         "add_special_tokens": True})
    with_bos, without = (r.prompt_token_ids for r in engine.submitted)
    assert with_bos[0] == bos_tokenizer.hf.bos_token_id and without == with_bos[1:]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "add_special_tokens"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_gives_the_prompt_s_and_each_choice_s_ids_whole_and_streamed(tokenizer, path):
    """vLLM's return_token_ids: the prompt's ids (a chat's at the top, a completion's on each
    choice; streamed, once, first) and each choice's ids, the stream's adding up to the
    whole's; without it, neither field."""
    chat = path.endswith("chat/completions")
    body = {"model": "tiny", "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 3,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    client, engine = gateway(tokenizer)
    with client:
        plain = client.post(path, json=body).json()
        whole = client.post(path, json={**body, "return_token_ids": True}).json()
        with client.stream("POST", path, json={**body, "return_token_ids": True, "stream": True}) as resp:
            events = sse_events(resp)
    prompt = engine.submitted[1].prompt_token_ids
    script = tokenizer.encode(SCRIPT, add_special_tokens=False)[:8]
    assert "prompt_token_ids" not in plain and all("token_ids" not in c for c in plain["choices"])
    assert [c["stop_reason"] for c in plain["choices"]] == [None, None]  # (vLLM's: no stop string or token)
    assert [c["token_ids"] for c in whole["choices"]] == [script, script]
    streamed = {0: [], 1: []}
    prompts = []
    for event in events:
        prompts += [event["prompt_token_ids"]] if "prompt_token_ids" in event else []
        for c in event["choices"]:
            streamed[c["index"]] += c.get("token_ids", [])
            prompts += [c["prompt_token_ids"]] if "prompt_token_ids" in c else []
    assert streamed == {0: script, 1: script}
    if chat:
        assert whole["prompt_token_ids"] == prompt and prompts == [prompt]
    else:
        assert [c["prompt_token_ids"] for c in whole["choices"]] == [prompt, prompt] and prompts == [prompt, prompt]


def test_tokenize_of_messages_gives_the_chat_prompt_tools_included(tmp_path):
    """Through the tools' template (SmolLM2's reads no tools: Hermes-style messages), the
    ids a chat completion of the same messages submits; `tool_choice: none` leaves the
    tools out of both."""
    from tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path / "chat", "llama")
    tok = Tokenizer(folder)
    client, engine = gateway(tok)
    engine.max_model_len = 1024  # the tools' prompt is ~380 tokens in the tiny vocabulary
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    got = {}
    with client:
        for choice in ("auto", "none"):
            chat = {"model": "tiny", "messages": messages, "tools": tools, "tool_choice": choice}
            client.post("/v1/chat/completions", json={**chat, "max_tokens": 1})
            got[choice] = client.post("/tokenize", json=chat).json()["tokens"]
        plain = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert [got["auto"], got["none"]] == [r.prompt_token_ids for r in engine.submitted]
    assert got["none"] == plain != got["auto"]
    assert plain == tok.apply_chat_template(messages)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_tokenize_input_is_a_4xx_naming_its_field(tokenizer, path, body, status, param):
    client, _ = gateway(tokenizer)
    with client:
        resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param


def test_detokenize_reads_ids_back_as_text_special_tokens_kept(bos_tokenizer):
    tokenizer = bos_tokenizer
    client, _ = gateway(tokenizer)
    ids = tokenizer.encode(SCRIPT)  # with the BOS token
    with client:
        body = client.post("/detokenize", json={"model": "tiny", "tokens": ids}).json()
        version = client.get("/version").json()
    assert body == {"prompt": tokenizer.hf.bos_token + SCRIPT}
    assert version == {"version": importlib.metadata.version("llmbus")}


def test_the_version_of_a_checkout_never_installed_is_pyprojects(monkeypatch):
    """A GPU lease runs the services from a checkout on PYTHONPATH, with no distribution
    metadata: the gateway's import read it and exited at start-up there."""
    import tomllib
    from pathlib import Path

    from shared.version import llmbus_version

    installed = importlib.metadata.version

    def version(name):
        if name == "llmbus":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert llmbus_version() == pyproject["project"]["version"] == installed("llmbus")


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(tokenizer):
    client, _ = gateway(tokenizer)
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    with client:
        whole = client.post("/v1/chat/completions", json=request).json()
        with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True, "stream_options": {
                "include_usage": True, "continuous_usage_stats": True}}) as resp:
            events = sse_events(resp)
        with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True, "stream_options": {
                "continuous_usage_stats": True}}) as resp:  # without include_usage: none (as vLLM)
            plain = sse_events(resp)
    usages = [e["usage"] for e in events]
    assert events[-1]["choices"] == [] and usages[-1] == whole["usage"]
    assert {u["prompt_tokens"] for u in usages} == {whole["usage"]["prompt_tokens"]}
    done = [u["completion_tokens"] for u in usages[1:-1]]  # after the role's chunk, one per text chunk
    assert done == sorted(set(done)) and done[-1] == whole["usage"]["completion_tokens"]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert all("usage" not in e for e in plain)


@pytest.mark.parametrize("options, param", [
    ({"include_usage": True}, "stream_options"),  # stream_options without stream
    ({"include_usage": True, "continuous": True}, "stream_options.continuous"),
])
def test_stream_options_are_checked(tokenizer, options, param):
    client, _ = gateway(tokenizer)
    body = {"model": "tiny", "prompt": "hi", "stream_options": options, "stream": "continuous" in options}
    with client:
        resp = client.post("/v1/completions", json=body)
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, param)


def test_tokenizer_info_serves_what_a_remote_tokenizer_reads_when_enabled(tokenizer):
    """lm-evaluation-harness's remote tokenizer: /tokenizer_info's special tokens and
    template, then /tokenize with add_special_tokens false and /detokenize."""
    async def factory(on_stats):
        return FakeEngine(tokenizer)

    with TestClient(create_app(factory, tokenizer, GatewayConfig("tiny", enable_tokenizer_info_endpoint=True))) as c:
        info = c.get("/tokenizer_info").json()
        ids = c.post("/tokenize", json={"prompt": SCRIPT, "add_special_tokens": False}).json()["tokens"]
        text = c.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert info["eos_token"] == tokenizer.hf.eos_token and info["chat_template"] == tokenizer.hf.chat_template
    assert info["bos_token"] == tokenizer.hf.bos_token and info["tokenizer_class"] == type(tokenizer.hf).__name__
    assert (ids, text) == (tokenizer.encode(SCRIPT, add_special_tokens=False), SCRIPT)
    client, _ = gateway(tokenizer)
    with client:
        assert client.get("/tokenizer_info").status_code == 404  # off unless asked for, as vLLM's


def test_chat_template_kwargs_and_continue_final_message_shape_the_prompt(tiny_llama):
    """vLLM's chat fields: the template's own variables (Qwen3's templates read
    enable_thinking), and a last assistant message left open for the model to go on from;
    /tokenize renders them the same."""
    tok = Tokenizer(tiny_llama)
    tok.hf.chat_template += "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    client, engine = gateway(tok)
    ask = [{"role": "user", "content": "hi"}]
    started = [*ask, {"role": "assistant", "content": "The answer is"}]
    with client:
        for body in ({"messages": ask}, {"messages": ask, "chat_template_kwargs": {"enable_thinking": False}},
                     {"messages": started, "add_generation_prompt": False, "continue_final_message": True}):
            client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, **body})
        tokenized = client.post("/tokenize", json={"messages": ask, "chat_template_kwargs": {"enable_thinking": False}})
    plain, thinking_off, continued = [tok.hf.decode(r.prompt_token_ids) for r in engine.submitted]
    assert thinking_off == plain + "<think></think>" and "<think>" not in plain
    assert continued.endswith("<|im_start|>assistant\nThe answer is")
    assert tokenized.json()["tokens"] == engine.submitted[1].prompt_token_ids


def test_a_chat_s_documents_reach_a_rag_template(tiny_llama):
    """vLLM's `documents`: what a RAG template (Granite's, Command R's) shows the model,
    through the tokenizer's own path; a document that is not strings is a 400 naming it."""
    template = ("{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    tok = Tokenizer(tiny_llama, chat_template=template)
    client, engine = gateway(tok)
    ask = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with client:
        client.post("/v1/chat/completions", json={**ask, "documents": [{"title": "A", "text": "one"},
                                                                       {"title": "B", "text": "two"}]})
        client.post("/v1/chat/completions", json=ask)
        bad = client.post("/v1/chat/completions", json={**ask, "documents": [{"title": 1}]})
    assert [tok.hf.decode(r.prompt_token_ids) for r in engine.submitted] == ["[A: one][B: two]hi", "hi"]
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "documents")


@pytest.mark.parametrize("extra, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt (the default)
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"big": 2**70}}, "chat_template_kwargs"),
])
def test_chat_template_options_that_cannot_be_are_400s(tokenizer, extra, param):
    client, engine = gateway(tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    with client:
        answers = [client.post("/v1/chat/completions", json={"model": "tiny", **body}),
                   client.post("/tokenize", json=body)]
    assert [(a.status_code, a.json()["error"]["param"]) for a in answers] == [(400, param)] * 2
    assert engine.submitted == []


def test_truncate_prompt_tokens_keeps_the_prompt_s_end(tokenizer):
    """vLLM's field: the last k tokens (-1: as many as the context holds beside max_tokens);
    the echo is what remains of the prompt."""
    client, engine = gateway(tokenizer)
    ids = tokenizer.encode(SCRIPT)
    long = ids * (300 // len(ids) + 1)  # past the fake engine's 256-token context
    with client:
        body = client.post("/v1/completions", json={"model": "tiny", "prompt": SCRIPT, "max_tokens": 1,
                                                    "truncate_prompt_tokens": 5, "echo": True}).json()
        client.post("/v1/completions", json={"model": "tiny", "prompt": long, "max_tokens": 1,
                                             "truncate_prompt_tokens": -1})
        bad = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "truncate_prompt_tokens": 0})
    first, whole_context = engine.submitted
    assert first.prompt_token_ids == ids[-5:] and body["usage"]["prompt_tokens"] == 5
    assert body["choices"][0]["text"].startswith(tokenizer.decode(ids[-5:], skip_special_tokens=False))
    assert whole_context.prompt_token_ids == long[-255:]  # room for max_tokens
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "truncate_prompt_tokens")


def test_models_and_ping_say_what_vllm_s_do(tokenizer):
    client, _ = gateway(tokenizer)
    with client:
        card = client.get("/v1/models").json()["data"][0]
        pings = [client.get("/ping"), client.post("/ping")]
    assert (card["id"], card["max_model_len"]) == ("tiny", 256)
    assert [p.status_code for p in pings] == [200, 200] and pings[0].json()["status"] == "ok"


def test_a_model_is_retrieved_by_id_and_unknown_paths_answer_in_openais_shape(tokenizer):
    """OpenAI's GET /v1/models/{id} (the openai client's models.retrieve), and routing's 404
    and 405 in OpenAI's error shape, not FastAPI's {"detail": ...}."""
    import openai

    client, _ = gateway(tokenizer)
    with client:
        card = client.get("/v1/models/tiny")
        unknown = client.get("/v1/models/org/other")
        no_path = client.post("/v1/nonexistent", json={})
        wrong_method = client.delete("/v1/chat/completions")
        listed = client.get("/v1/models").json()["data"][0]
        sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client)
        assert sdk.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError, match="`org/other` does not exist"):
            sdk.models.retrieve("org/other")
    assert card.status_code == 200 and card.json() == listed
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert no_path.status_code == 404 and no_path.json()["error"] == {
        "message": "Invalid URL (POST /v1/nonexistent)", "type": "invalid_request_error", "param": None, "code": 404}
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["message"] == "DELETE is not allowed on /v1/chat/completions"


def test_allowed_token_ids_reach_the_engine_and_an_empty_list_is_a_400(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "allowed_token_ids": [5, 9]})
        empty = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "allowed_token_ids": []})
    assert engine.submitted[0].sampling_params.allowed_token_ids == [5, 9]
    assert (empty.status_code, empty.json()["error"]["param"]) == (400, "allowed_token_ids")


def test_priority_reaches_the_engine_with_each_request(tokenizer):
    client, engine = gateway(tokenizer)
    with client:
        client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "priority": -3})
    assert [r.priority for r in engine.submitted] == [-3] * 4


def test_further_served_model_names_are_aliases_the_first_answers_for(tokenizer):
    client, engine = gateway(tokenizer, config=GatewayConfig("tiny", model_aliases=("gpt-4o-mini",)))
    with client:
        answer = client.post("/v1/completions", json={"model": "gpt-4o-mini", "prompt": "hi", "max_tokens": 2})
        cards = [card["id"] for card in client.get("/v1/models").json()["data"]]
        unknown = client.post("/v1/completions", json={"model": "gpt-5", "prompt": "hi"})
    assert answer.status_code == 200 and answer.json()["model"] == "tiny" and len(engine.submitted) == 1
    assert cards == ["tiny", "gpt-4o-mini"]
    assert unknown.status_code == 404 and "serves `tiny`, `gpt-4o-mini`" in unknown.json()["error"]["message"]


def test_cors_as_vllms_defaults_and_flags_set_it(tokenizer):
    """Any origin by default (vLLM's): a browser's preflight, which carries no API key, is
    answered before the key check, and the answer itself names the origin; --allowed-origins
    narrows it."""
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    client, _ = gateway(tokenizer, config=GatewayConfig("tiny", api_keys=("k",)))
    with client:
        allowed = client.options("/v1/completions", headers=preflight)
        answer = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                             headers={"Origin": "https://ui.example", "Authorization": "Bearer k"})
        keyless = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"},
                              headers={"Origin": "https://ui.example"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    assert keyless.status_code == 401  # CORS opens no door the key closes
    narrow = GatewayConfig("tiny", allowed_origins=("https://ui.example",))
    client, _ = gateway(tokenizer, config=narrow)
    with client:
        ours = client.options("/v1/completions", headers=preflight)
        theirs = client.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert ours.headers["access-control-allow-origin"] == "https://ui.example"
    assert theirs.status_code == 400 and "access-control-allow-origin" not in theirs.headers


def test_a_client_s_request_id_names_the_response_not_the_engine_s_request(tokenizer, caplog):
    """vLLM's X-Request-Id (over the body's request_id): the response's id, streamed and
    not, and the request log's client_request_id; the engine's ids stay unique for two
    requests sent with one id. With --enable-request-id-headers each response carries the
    header back, the sent one or a new one, errors included; an id too long is a 400."""
    import logging

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    client, engine = gateway(tokenizer, config=GatewayConfig("tiny", enable_request_id_headers=True))
    with client, caplog.at_level(logging.INFO, logger="llmbus.requests"):
        sent = client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-7"})
        again = client.post("/v1/chat/completions", json={**chat, "request_id": "body-1"},
                            headers={"X-Request-Id": "trace-7"})
        by_body = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "request_id": "body-1"})
        streamed = client.post("/v1/chat/completions", json={**chat, "stream": True}, headers={"X-Request-Id": "s-1"})
        plain = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        refused = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "request_id": "x" * 257})
    assert sent.json()["id"] == again.json()["id"] == "chatcmpl-trace-7"
    assert by_body.json()["id"] == "cmpl-body-1"
    assert {e["id"] for e in sse_events(streamed)} == {"chatcmpl-s-1"}
    assert plain.json()["id"].startswith("cmpl-") and len(plain.json()["id"]) == 37  # ours
    assert [r.headers["x-request-id"] for r in (sent, again, by_body, streamed)] == ["trace-7", "trace-7",
                                                                                     by_body.headers["x-request-id"],
                                                                                     "s-1"]
    assert len(by_body.headers["x-request-id"]) == 32 and refused.headers["x-request-id"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_id"
    engine_ids = [r.request_id for r in engine.submitted]
    assert len(set(engine_ids)) == len(engine_ids) == 5 and not any("trace-7" in i for i in engine_ids)
    logged = [r.client_request_id for r in caplog.records if r.getMessage() == "request finished"]
    assert logged == ["trace-7", "trace-7", "body-1", "s-1", None]
    client, _ = gateway(tokenizer)
    with client:
        assert "x-request-id" not in client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).headers


def test_the_api_s_own_docs_are_served_unless_disabled(tokenizer):
    """FastAPI's /docs and /openapi.json, as vLLM serves them; --disable-fastapi-docs takes
    them away (a 404 in OpenAI's shape)."""
    client, _ = gateway(tokenizer)
    with client:
        assert client.get("/openapi.json").json()["paths"]["/v1/chat/completions"]
        assert client.get("/docs").status_code == 200
    client, _ = gateway(tokenizer, config=GatewayConfig("tiny", disable_fastapi_docs=True))
    with client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            refused = client.get(path)
            assert refused.status_code == 404 and refused.json()["error"]["code"] == 404


class SilentEngine(FakeEngine):
    """Takes each request and never answers it."""

    async def submit(self, request) -> None:
        self.submitted.append(request)


# A POST to /v1/completions as a server hands it to the app (for tests that play the client's
# side of the ASGI conversation themselves)
COMPLETIONS_SCOPE = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
    "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
    "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_that_leaves_a_whole_answer_aborts_its_requests_without_an_error(tokenizer, n):
    """A non-streamed request whose client goes before the engine answers: its requests are
    aborted in the engine, the answer is 499 (client left), and nothing raises in the app
    (the gateway once closed the output stream while its reader was still inside it, and
    uvicorn logged 'Exception in ASGI application' for each such client)."""
    client, engine = gateway(tokenizer, engine_class=SilentEngine)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 5, "n": n}).encode()
    scope = dict(COMPLETIONS_SCOPE)  # (the app writes into its scope)
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():  # the body, then the client is gone
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    with client:
        client.portal.call(client.app, scope, receive, send)  # (raises what the app raises)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [499]
    assert len(engine.submitted) == n and sorted(engine.aborted) == sorted(r.request_id for r in engine.submitted)


class FirstTokenEngine(FakeEngine):
    """Answers each request's first token, then nothing more."""

    async def submit(self, request) -> None:
        self.submitted.append(request)
        token_id = self.tokenizer.encode(self.script, add_special_tokens=False)[0]
        self.queues[request.request_id].put_nowait(EngineCoreOutput(request.request_id, [token_id], None))


def test_a_client_that_leaves_a_stream_aborts_its_request_at_once_and_nothing_raises(tokenizer):
    """A streamed answer's events go to the server's own send (event_stream.py), past the
    middlewares; a client that leaves while the engine is silent still ends the stream at
    once: the engine request is aborted, the server's load drops, no end is written to a
    client that left, and nothing raises in the app."""
    client, engine = gateway(tokenizer, engine_class=FirstTokenEngine)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True}).encode()
    scope = dict(COMPLETIONS_SCOPE)  # (the app writes into its scope)
    sent = []

    async def run():
        import asyncio

        first_token = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():  # the body, then, once the first token is out, the client is gone
            if messages:
                return messages.pop(0)
            await first_token.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if b'"text"' in message.get("body", b""):
                first_token.set()

        await asyncio.wait_for(client.app(scope, receive, send), 10)

    with client:
        client.portal.call(run)  # (raises what the app raises; a stream that never ends: a timeout)
        assert client.app.state.serving.server_load == 0
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 1 and bodies[0]["more_body"] and b'"text"' in bodies[0]["body"]
    assert [r.request_id for r in engine.submitted] == engine.aborted and len(engine.aborted) == 1


def test_vllms_request_logging_flags_log_prompts_params_and_outputs_cut_to_max_log_len(tokenizer, caplog):
    """--enable-log-requests: a line as each request arrives (its prompt as tokenized and
    its parameters); --enable-log-outputs: each choice's text and ids on its finished line;
    --max-log-len cuts texts and id lists. Without them: neither."""
    import logging

    def lines(config, stream: bool):
        caplog.clear()
        client, _ = gateway(tokenizer, config=config)
        body = {"model": "tiny", "prompt": "hello there friend", "max_tokens": 8, "n": 2, "temperature": 0.5,
                "seed": 3, "stream": stream}
        with caplog.at_level(logging.INFO, logger="llmbus.requests"), client:
            with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                resp.read()
        return ([r for r in caplog.records if r.getMessage() == "request received"],
                [r for r in caplog.records if r.getMessage() == "request finished"])

    prompt = tokenizer.encode("hello there friend")
    answer = tokenizer.encode(SCRIPT, add_special_tokens=False)[:8]
    for stream in (False, True):
        received, finished = lines(GatewayConfig("tiny", log_request_inputs=True, log_outputs=True, max_log_len=5),
                                   stream)
        assert len(received) == len(finished) == 1
        assert received[0].prompts == [{"text": tokenizer.decode(prompt, skip_special_tokens=False)[:5],
                                        "token_ids": prompt[:5]}]
        params = received[0].params
        assert (params["n"], params["max_tokens"], params["temperature"], params["seed"]) == (2, 8, 0.5, 3)
        shown = tokenizer.decode(answer, skip_special_tokens=True)[:5]
        assert finished[0].outputs == [{"index": i, "text": shown, "token_ids": answer[:5], "finish_reason": "length"}
                                       for i in range(2)]
    received, finished = lines(GatewayConfig("tiny"), stream=True)
    assert received == [] and len(finished) == 1 and not hasattr(finished[0], "outputs")


def test_a_client_that_leaves_while_sending_its_body_is_a_quiet_499():
    """Starlette's ClientDisconnect reached the server's error log as a traceback."""
    import asyncio
    from types import SimpleNamespace

    from starlette.requests import Request

    from services.gateway.errors import ClientLeft
    from services.gateway.serving import OpenAIServing

    messages = [{"type": "http.request", "body": b'{"model": ', "more_body": True}, {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)
    with pytest.raises(ClientLeft) as left:
        asyncio.run(OpenAIServing.read_body(SimpleNamespace(config=SimpleNamespace(max_body_bytes=1000)), request))
    assert left.value.status == 499
