"""OpenAI's Responses API over the chat path, read by the real openai client: the same
prompt a chat gets, output items and their streamed events adding up to the response
sent whole, tool calls and reasoning as items, and what is not implemented refused by name."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.tokenizer.tokenizer import Tokenizer
from shared.config import GatewayConfig
from test_gateway import SCRIPT, FakeEngine

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def serve(tiny_llama, script: str = SCRIPT, **config):
    tokenizer = Tokenizer(tiny_llama)
    engine = type("Scripted", (FakeEngine,), {"script": script, "max_model_len": 1024})(tokenizer)

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
    assert (whole.instructions, whole.text.format.type, whole.store) == ("Be brief.", "text", False)
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
    """developer is system; a function_call item the assistant's call, its output a tool
    turn; a past reasoning item is dropped; a cache salt goes with it."""
    test_client, client, engine, tokenizer = serve(tiny_llama)
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    with test_client:
        client.responses.create(model="tiny", input=items, tools=[WEATHER], max_output_tokens=5,
                                extra_body={"cache_salt": "tenant-1"})
    assert engine.submitted[0].cache_salt == "tenant-1"  # (vLLM's, as on chat)
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
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


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "computer_call"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"truncation": "auto"}, "truncation"),
    ({"store": True}, "store"),
])
def test_what_is_not_implemented_or_wrong_is_a_400_naming_it(tiny_llama, extra, param):
    test_client, _, engine, _ = serve(tiny_llama)
    with test_client:
        resp = test_client.post("/v1/responses", json={"model": "tiny", "input": "hi", **extra})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, param), resp.text
    assert engine.submitted == []
