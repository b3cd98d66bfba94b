"""OpenAI's Responses API over the chat path, read by the real openai client: the same
prompt a chat gets, output items and their streamed events adding up to the response
sent whole, tool calls and reasoning as items, stored responses that a conversation goes
on from, and what is not implemented refused by name."""

from __future__ import annotations

import base64
import json

import openai
import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.responses_api.store import ResponseStore, StoredResponse
from services.tokenizer.tokenizer import Tokenizer
from shared.config import GatewayConfig
from shared.messages import EngineCoreOutput, FinishReason, Logprobs
from test_gateway import SCRIPT, FakeEngine

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class LogprobsEngine(FakeEngine):
    """SCRIPT's tokens, each with made-up logprobs: its own, then k alternatives."""

    async def submit(self, request) -> None:
        self.submitted.append(request)
        k = request.sampling_params.logprobs
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)[: request.sampling_params.max_tokens]
        for i, token_id in enumerate(ids):
            logprobs = [] if k is None else [Logprobs([token_id, *range(3, 3 + k)],
                                                      [-0.25 * i, *(-1.0 - j for j in range(k))], 1)]
            self.queues[request.request_id].put_nowait(EngineCoreOutput(
                request.request_id, [token_id], FinishReason.LENGTH if i == len(ids) - 1 else None,
                new_logprobs=logprobs))


def serve(tiny_llama, script: str = SCRIPT, engine_class=FakeEngine, chat_template: str | None = None, **config):
    tokenizer = Tokenizer(tiny_llama, chat_template=chat_template)
    engine = type("Scripted", (engine_class,), {"script": script, "max_model_len": 1024})(tokenizer)

    async def factory(on_stats):
        return engine

    test_client = TestClient(create_app(factory, tokenizer, GatewayConfig("tiny", **config)))
    return test_client, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=test_client,
                                      max_retries=0), engine, tokenizer


def test_a_response_is_the_chat_answer_streamed_and_not(tiny_llama):
    test_client, client, engine, tokenizer = serve(tiny_llama)
    with test_client:
        whole = client.responses.create(model="tiny", input="hi", instructions="Be brief.", max_output_tokens=200,
                                        safety_identifier="s1", prompt_cache_key="k1")  # (bookkeeping: accepted)
        events = list(client.responses.create(model="tiny", input="hi", instructions="Be brief.",
                                              max_output_tokens=200, stream=True))
        # The client's own accumulating stream (it refuses an output index announced twice)
        with client.responses.stream(model="tiny", input="hi", max_output_tokens=200) as stream:
            accumulated = stream.get_final_response()
    assert accumulated.output_text == SCRIPT and [o.type for o in accumulated.output] == ["message"]
    assert whole.output_text == SCRIPT and whole.status == "incomplete"  # the fake engine ends on length
    assert (whole.instructions, whole.text.format.type, whole.store) == ("Be brief.", "text", True)
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.input_tokens == len(engine.submitted[0].prompt_token_ids)
    assert engine.submitted[0].prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == SCRIPT
    done = events[-1].response
    assert done.output_text == SCRIPT and done.output[0].id == events[2].item.id
    assert [o.type for o in done.output] == [o.type for o in whole.output] == ["message"]


def test_input_items_become_the_conversation_a_chat_would_render(tiny_llama):
    """developer is system; a function_call item the assistant's call (in the turn of the
    assistant's text before it), its output a tool turn; a past reasoning item is dropped;
    a cache salt goes with it."""
    test_client, client, engine, tokenizer = serve(tiny_llama)
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    with test_client:
        client.responses.create(model="tiny", input=items, tools=[WEATHER], max_output_tokens=5,
                                extra_body={"cache_salt": "tenant-1"})
    assert engine.submitted[0].cache_salt == "tenant-1"  # (vLLM's, as on chat)
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "call_1", "type": "function",
                                                                      "function": {"name": "get_weather",
                                                                                   "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert engine.submitted[0].prompt_token_ids == tokenizer.apply_chat_template(chat, tools=tools)


def test_a_tool_call_and_the_thinking_are_output_items(tiny_llama):
    test_client, client, _, _ = serve(tiny_llama, "<think>Ask the tool.</think>" + CALL, reasoning_parser="qwen3")
    with test_client:
        whole = client.responses.create(model="tiny", input="weather?", tools=[WEATHER], max_output_tokens=400)
        events = list(client.responses.create(model="tiny", input="weather?", tools=[WEATHER], max_output_tokens=400,
                                              stream=True))
        with client.responses.stream(model="tiny", input="weather?", tools=[WEATHER], max_output_tokens=400) as stream:
            accumulated = stream.get_final_response()
    assert [(o.type, getattr(o, "arguments", None)) for o in accumulated.output] == [
        (o.type, getattr(o, "arguments", None)) for o in whole.output]
    reasoning, call = whole.output
    assert (reasoning.type, reasoning.content[0].text) == ("reasoning", "Ask the tool.")
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_")
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Ask the tool."
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]


def test_the_output_text_has_its_logprobs_when_included(tiny_llama):
    """include message.output_text.logprobs with top_logprobs: chat's logprobs entries, the
    streamed deltas' adding up to the whole; left out, none are computed."""
    test_client, client, engine, _ = serve(tiny_llama, engine_class=LogprobsEngine)
    asked = dict(model="tiny", input="hi", max_output_tokens=6, include=["message.output_text.logprobs"],
                 top_logprobs=2)
    with test_client:
        whole = client.responses.create(**asked)
        events = list(client.responses.create(stream=True, **asked))
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, logprobs=True, top_logprobs=2)
        plain = client.responses.create(model="tiny", input="hi", max_output_tokens=6)
    want = [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert len(want) == 6 and [len(e["top_logprobs"]) for e in want] == [2] * 6
    assert [e.model_dump() for e in whole.output[0].content[0].logprobs] == want
    streamed = [e.model_dump() for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert streamed == want
    assert [e.model_dump() for e in events[-1].response.output[0].content[0].logprobs] == want
    assert plain.output[0].content[0].logprobs is None and engine.submitted[-1].sampling_params.logprobs is None


# What the OpenAI Agents SDK (openai-agents 0.24) sent for an agent with a function tool,
# recorded: `include` and `tools` always, as lists, empty or not; the call item as the
# previous response gave it (id, status); then a turn going on by previous_response_id.
AGENT_TOOL = {"name": "get_weather", "parameters": {"properties": {"city": {"title": "City", "type": "string"}},
              "required": ["city"], "title": "get_weather_args", "type": "object", "additionalProperties": False},
              "strict": True, "type": "function", "description": "The weather in a city."}
AGENT_TURNS = [
    {"model": "tiny", "include": [], "input": [{"content": "What's the weather in Paris?", "role": "user"}],
     "instructions": "Use tools.", "max_output_tokens": 80, "temperature": 0.0, "tool_choice": "required",
     "tools": [AGENT_TOOL]},
    {"model": "tiny", "include": [], "input": [
        {"content": "What's the weather in Paris?", "role": "user"},
        {"arguments": "{\"city\": \"Paris\"}", "call_id": "call_cc3b", "name": "get_weather", "type": "function_call",
         "id": "fc_cc3b", "status": "completed"},
        {"call_id": "call_cc3b", "output": "sunny in Paris", "type": "function_call_output"}],
     "instructions": "Use tools.", "max_output_tokens": 80, "temperature": 0.0, "tools": [AGENT_TOOL]},
    {"model": "tiny", "include": [], "input": [{"content": "And again?", "role": "user"}],
     "instructions": "You are helpful.", "max_output_tokens": 60, "temperature": 0.0, "tools": []},
]


def test_the_agents_sdk_requests_are_served(tiny_llama):
    test_client, _, engine, tokenizer = serve(tiny_llama)
    with test_client:
        answers = [test_client.post("/v1/responses", json=body) for body in AGENT_TURNS[:2]]
        chained = test_client.post("/v1/responses",
                                   json={**AGENT_TURNS[2], "previous_response_id": answers[1].json()["id"]})
    assert [a.status_code for a in answers] == [200, 200] and chained.status_code == 200, chained.text
    tools = [{"type": "function",
              "function": {k: AGENT_TOOL[k] for k in ("name", "description", "parameters", "strict")}}]
    call = {"id": "call_cc3b", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [{"role": "user", "content": "What's the weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_cc3b", "content": "sunny in Paris"}]
    assert engine.submitted[1].prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Use tools."}, *conversation], tools=tools)
    # tools: [] is no tools: the prompt shows none
    assert engine.submitted[2].prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are helpful."}, *conversation, {"role": "assistant", "content": SCRIPT},
         {"role": "user", "content": "And again?"}])


@pytest.mark.parametrize("extra, param", [
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "computer_call"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
])
def test_what_is_not_implemented_or_wrong_is_a_400_naming_it(tiny_llama, extra, param):
    test_client, _, engine, _ = serve(tiny_llama)
    with test_client:
        resp = test_client.post("/v1/responses", json={"model": "tiny", "input": "hi", **extra})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, param), resp.text
    assert engine.submitted == []


def test_a_response_goes_on_from_a_stored_one(tiny_llama):
    """previous_response_id: the stored conversation (input and output, the earlier turns
    too) before this input, under this request's instructions alone (OpenAI's rule);
    streamed responses are stored as those sent whole."""
    test_client, client, engine, tokenizer = serve(tiny_llama)
    with test_client:
        first = client.responses.create(model="tiny", input="hi", instructions="Be brief.", max_output_tokens=200)
        with client.responses.stream(model="tiny", input="more", previous_response_id=first.id,
                                     instructions="Be kind.", max_output_tokens=200) as stream:
            second = stream.get_final_response()
        third = client.responses.create(model="tiny", input=[{"role": "user", "content": "again"}],
                                        previous_response_id=second.id, max_output_tokens=200)
    assert (second.previous_response_id, third.previous_response_id) == (first.id, second.id)
    assert len({first.id, second.id, third.id}) == 3
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": SCRIPT},
             {"role": "user", "content": "more"}]
    assert engine.submitted[1].prompt_token_ids == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be kind."}, *turns])
    assert engine.submitted[2].prompt_token_ids == tokenizer.apply_chat_template(
        [*turns, {"role": "assistant", "content": SCRIPT}, {"role": "user", "content": "again"}])


def weather_answered(tokenizer, call) -> list[int]:
    """The prompt of "weather?", the model's call and its output "sunny", as a chat."""
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    return tokenizer.apply_chat_template(chat, tools=tools)


def test_a_tool_call_goes_on_with_its_output(tiny_llama):
    """The agent loop: a response calls a function, the next sends only the call's output
    and previous_response_id; the call is the assistant's turn (its thinking dropped)."""
    test_client, client, engine, tokenizer = serve(tiny_llama, "<think>Ask the tool.</think>" + CALL,
                                                   reasoning_parser="qwen3")
    with test_client:
        asked = client.responses.create(model="tiny", input="weather?", tools=[WEATHER], max_output_tokens=400)
        [call] = [o for o in asked.output if o.type == "function_call"]
        client.responses.create(model="tiny", previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=400,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert engine.submitted[1].prompt_token_ids == weather_answered(tokenizer, call)


def test_a_stored_response_is_read_and_deleted_by_id(tiny_llama):
    test_client, client, engine, _ = serve(tiny_llama)
    with test_client:
        whole = client.responses.create(model="tiny", input="hi", max_output_tokens=200)
        streamed = list(client.responses.create(model="tiny", input="hi", max_output_tokens=200, stream=True))
        done = streamed[-1].response
        assert client.responses.retrieve(whole.id).model_dump() == whole.model_dump()
        assert client.responses.retrieve(done.id).model_dump() == done.model_dump()
        assert test_client.get(f"/v1/responses/{whole.id}?stream=true").json()["error"]["param"] == "stream"
        client.responses.delete(whole.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(whole.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(whole.id)
        unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=200, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        submitted = len(engine.submitted)
        gone = test_client.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                                       "previous_response_id": whole.id})
        assert client.responses.retrieve(done.id).id == done.id  # (the others kept)
    assert unstored.store is False and whole.store is True
    error = gone.json()["error"]
    assert (gone.status_code, error["param"], error["code"]) == (404, "previous_response_id",
                                                                 "previous_response_not_found")
    assert len(engine.submitted) == submitted


def test_a_server_storing_nothing_refuses_store_by_name(tiny_llama):
    from llmbus.cli.args import gateway_config
    from llmbus.cli.main import build_parser

    def store_bytes(mb: str) -> int:
        return gateway_config(build_parser().parse_args(["gateway", "--responses-store-mb", mb]), "tiny",
                              ".").responses_store_bytes

    assert store_bytes("0.5") == 512 << 10
    test_client, client, engine, _ = serve(tiny_llama, responses_store_bytes=store_bytes("0"))
    with test_client:
        refused = test_client.post("/v1/responses", json={"model": "tiny", "input": "hi", "store": True})
        answered = client.responses.create(model="tiny", input="hi", max_output_tokens=5)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(answered.id)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "store")
    assert answered.store is False and len(engine.submitted) == 1


def test_the_store_drops_the_least_recently_used_beyond_its_size():
    entry = lambda n: StoredResponse(b"r" * n, b"c" * n)  # noqa: E731
    store = ResponseStore(max_bytes=100)
    store.put("a", entry(20))
    store.put("b", entry(20))
    assert store.get("a") is not None  # (read: now the most recently used)
    store.put("c", entry(20))  # 120 bytes: b goes
    assert (store.get("b"), store.num_bytes, len(store)) == (None, 80, 2)
    store.put("a", entry(5))  # a client-named id again: replaced, not counted twice
    assert (store.get("a").size, store.num_bytes) == (10, 50)
    store.put("huge", entry(51))  # larger than the whole store: not kept, nothing dropped for it
    assert (store.get("huge"), store.num_bytes, len(store)) == (None, 50, 2)


def test_reasoning_effort_is_the_templates_variable(tiny_llama):
    """Chat's reasoning_effort and a Response's reasoning.effort reach the chat template as
    `reasoning_effort` (vLLM's), chat_template_kwargs winning; a made-up effort is a 400."""
    template = "{{ reasoning_effort | default('unset') }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    test_client, client, engine, tokenizer = serve(tiny_llama, chat_template=template)
    hi = [{"role": "user", "content": "hi"}]
    with test_client:
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, reasoning_effort="low")
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, reasoning_effort="low",
                                       extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2)
        answer = client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                         reasoning={"effort": "medium", "summary": "auto"})
        bad = test_client.post("/v1/chat/completions", json={"model": "tiny", "messages": hi,
                                                             "reasoning_effort": "extreme"})
    prompts = [tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False) for r in engine.submitted]
    assert prompts == ["low|hi", "high|hi", "unset|hi", "medium|hi"]
    assert (answer.reasoning.effort, answer.reasoning.summary) == ("medium", "auto")
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "reasoning_effort")


def test_a_stateless_client_gets_its_reasoning_back_to_send(tiny_llama):
    """What Codex sends (store false, include reasoning.encrypted_content, a reasoning
    effort and summary): the reasoning item carries the thinking as encrypted_content;
    sent back with the call's output, the reasoning item is dropped and the rest is the
    conversation."""
    test_client, client, engine, tokenizer = serve(tiny_llama, "<think>Ask the tool.</think>" + CALL,
                                                   reasoning_parser="qwen3")
    asked = dict(model="tiny", tools=[WEATHER], max_output_tokens=400, store=False,
                 include=["reasoning.encrypted_content"], reasoning={"effort": "medium", "summary": "auto"})
    with test_client:
        first = client.responses.create(input="weather?", **asked)
        streamed = list(client.responses.create(input="weather?", stream=True, **asked))
        reasoning, call = first.output
        client.responses.create(input=[{"role": "user", "content": "weather?"}, reasoning.model_dump(),
                                       call.model_dump(),
                                       {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
                                **asked)
    assert base64.b64decode(reasoning.encrypted_content).decode() == "Ask the tool." and reasoning.summary == []
    assert streamed[-1].response.output[0].encrypted_content == reasoning.encrypted_content
    assert engine.submitted[2].prompt_token_ids == weather_answered(tokenizer, call)


def test_vllms_api_server_flags_change_what_they_say(tiny_llama):
    """--return-tokens-as-token-ids (every request's default), --enable-force-include-usage
    (a stream that did not ask ends with its usage), --enable-server-load-tracking (GET
    /load: requests being answered). (--root-path: test_services_e2e, uvicorn's.)"""
    test_client, client, _, _ = serve(tiny_llama, engine_class=LogprobsEngine, return_tokens_as_token_ids=True,
                                      force_include_usage=True, server_load_tracking=True)
    hi = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with test_client:
        chat = client.chat.completions.create(logprobs=True, top_logprobs=1, **hi)
        with test_client.stream("POST", "/v1/chat/completions", json={**hi, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(lines)
            during = test_client.get("/load").json()
            events = [json.loads(line[len("data: "):]) for line in lines
                      if line.startswith("data: {")]
        after = test_client.get("/load").json()
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert (during, after) == ({"server_load": 1}, {"server_load": 0})


def test_a_stored_response_lists_its_input_items(tiny_llama):
    """GET /v1/responses/{id}/input_items through the openai client: the items it was
    generated from, the chained turns' too (inputs and answers), the newest first or in
    order, paged by limit and after; a call and its output as their items."""
    test_client, client, _, _ = serve(tiny_llama)
    with test_client:
        first = client.responses.create(model="tiny", input="hi", instructions="Be brief.", max_output_tokens=200)
        second = client.responses.create(model="tiny", previous_response_id=first.id, max_output_tokens=200, input=[
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": "more"}])
        newest_first = client.responses.input_items.list(second.id)
        in_order = list(client.responses.input_items.list(second.id, order="asc", limit=2))  # (every page)
        page = client.responses.input_items.list(second.id, order="asc", limit=2)
        bad = test_client.get(f"/v1/responses/{second.id}/input_items?limit=0")
        gone = test_client.get("/v1/responses/resp_nope/input_items")
    described = [(i.type, getattr(i, "role", None), i.content[0].text if i.type == "message" else
                  getattr(i, "output", None) or getattr(i, "name", None)) for i in in_order]
    assert described == [("message", "user", "hi"), ("message", "assistant", SCRIPT),
                         ("function_call", None, "get_weather"), ("function_call_output", None, "sunny"),
                         ("message", "user", "more")]
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(in_order)] and not newest_first.has_more
    assert page.has_more and [i.id for i in page.data] == [i.id for i in in_order[:2]]
    assert len({i.id for i in in_order}) == 5  # (each its own, the same at every read)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "limit") and gone.status_code == 404
