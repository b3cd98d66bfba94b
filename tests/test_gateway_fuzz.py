"""Fuzzing the gateway: bodies drawn from the request structs' own fields, each filled
with a value of the right type or of any JSON type (integers past 64 bits, odd strings,
nesting), and raw bytes that are not JSON or not UTF-8. Every answer is a 2xx or a 4xx
in OpenAI's shape, never a 5xx, and the gateway serves as before afterwards.

The fake engine encodes what it is sent as the bus would, so a request that cannot go on
the wire fails here as it would served."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
)
from services.gateway.responses_api.request import ResponsesRequest
from services.tokenizer.tokenizer import Tokenizer
from shared.bus import encode
from shared.messages import EngineCoreRequest
from test_gateway import FakeEngine, gateway

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**100), max_value=2**100),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def message():
    known = {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}
    return st.one_of(st.fixed_dictionaries(known), st.fixed_dictionaries(known, optional={"extra": json_values}))


PLAUSIBLE = {
    "model": st.just("tiny"),
    "prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(-5, 500), min_size=1, max_size=8)),
    "messages": st.lists(message(), min_size=1, max_size=3),
    "max_tokens": st.integers(-2, 300),
    "tokens": st.lists(st.integers(-5, 500), max_size=8),
    "input": st.one_of(st.text(min_size=1, max_size=30), st.lists(message(), min_size=1, max_size=3)),
    "n": st.integers(-1, 20),
    "temperature": st.floats(-1, 3),
    "stream": st.booleans(),
    "structured_outputs": st.one_of(
        st.fixed_dictionaries({"regex": json_values}), st.fixed_dictionaries({"choice": json_values}),
        st.fixed_dictionaries({"json": json_values}), st.dictionaries(st.text(max_size=8), json_values, max_size=3)),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                                             optional={"json_schema": json_values}),
}


VALID = {
    CompletionRequest: {"model": "tiny", "prompt": "hi", "max_tokens": 4},
    ChatCompletionRequest: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    TokenizePromptRequest: {"prompt": "hi"},
    TokenizeChatRequest: {"messages": [{"role": "user", "content": "hi"}]},
    DetokenizeRequest: {"tokens": [5, 6]},
    ResponsesRequest: {"model": "tiny", "input": "hi", "max_output_tokens": 4},
    EmbeddingRequest: {"model": "tiny", "input": "hi"},
}
PATHS = {CompletionRequest: "/v1/completions", ChatCompletionRequest: "/v1/chat/completions",
         TokenizePromptRequest: "/tokenize", TokenizeChatRequest: "/tokenize", DetokenizeRequest: "/detokenize",
         ResponsesRequest: "/v1/responses", EmbeddingRequest: "/v1/embeddings"}


def bodies(kind) -> st.SearchStrategy[dict]:
    """A valid body with one to three of the struct's fields (or an unknown one) set to a
    plausible value or to any JSON value, so that most bodies get past the first check
    and reach the deep ones (sampling params, tokenizing, the wire)."""
    names = [f.name for f in msgspec.structs.fields(kind)] + ["unknown"]
    value = {name: st.one_of(PLAUSIBLE.get(name, json_values), json_values) for name in names}
    changes = st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({name: value[name] for name in chosen})
    )
    return changes.map(lambda changed: {**VALID[kind], **changed})


# Raw bodies: anything, and JSON whose string holds bytes that are not UTF-8.
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.binary(min_size=1, max_size=8).map(lambda b: b'{"model": "tiny", "prompt": "' + b + b'"}'),
)


class EncodingEngine(FakeEngine):
    async def tokenize(self, request, headers=None, **options) -> list[int]:
        encode(request)
        return await super().tokenize(request, headers, **options)

    async def submit(self, request) -> None:
        # What would go on the bus must go on it, and come off it as the scheduler decodes it.
        msgspec.msgpack.decode(encode(request), type=EngineCoreRequest)
        await super().submit(request)


@pytest.fixture(scope="module")
def client(tiny_llama):
    test_client, _ = gateway(Tokenizer(tiny_llama), engine_class=EncodingEngine)
    with test_client:
        yield test_client


def check(resp) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert set(error) == {"message", "type", "param", "code"}


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies(CompletionRequest))
def test_completions_never_answer_5xx(client, body):
    check(client.post("/v1/completions", json=body))


@FUZZ
@given(body=bodies(ChatCompletionRequest))
def test_chat_completions_never_answer_5xx(client, body):
    check(client.post("/v1/chat/completions", json=body))


@FUZZ
@given(kind_body=st.sampled_from([TokenizePromptRequest, TokenizeChatRequest, DetokenizeRequest]).flatmap(
    lambda kind: st.tuples(st.just(kind), bodies(kind))))
def test_tokenize_and_detokenize_never_answer_5xx(client, kind_body):
    kind, body = kind_body
    check(client.post(PATHS[kind], json=body))


@FUZZ
@given(body=bodies(ResponsesRequest))
def test_responses_never_answer_5xx(client, body):
    check(client.post("/v1/responses", json=body))


@FUZZ
@given(body=bodies(EmbeddingRequest))
def test_embeddings_never_answer_5xx(client, body):
    check(client.post("/v1/embeddings", json=body))


@FUZZ
@given(raw=raw_bodies)
def test_bodies_that_are_not_json_or_not_utf8_are_400(client, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize",
                 "/detokenize"):
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        check(resp)


def test_the_known_cases_and_serving_afterwards(client):
    seed = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "seed": 2**80})
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "seed"
    utf8 = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\xff\xfe"}')
    assert utf8.status_code == 400 and "UTF-8" in utf8.json()["error"]["message"]
    extra = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi", "name": 2**80}]})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "messages"
    ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
