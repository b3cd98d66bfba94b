"""Reasoning read out of a chat answer (--reasoning-parser): the thinking apart from the
content, the same whichever way the text is cut into deltas, and served so."""

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.app import create_app
from services.gateway.reasoning_parsers import REASONING_PARSERS, TAGS, new_parser, prompt_opens_thinking
from services.tokenizer.tokenizer import Tokenizer
from shared.config import GatewayConfig
from test_gateway import FakeEngine, sse_events


@pytest.mark.parametrize("name, prompt_tail, text, expected", [
    ("deepseek_r1", "", "let me see</think>42", ("let me see", "42")),
    ("deepseek_r1", "", "<think>let me see</think>42", ("let me see", "42")),
    ("deepseek_r1", "", "still thinking", ("still thinking", "")),  # never closed: max_tokens ran out
    ("qwen3", "<|im_start|>assistant\n", "<think>\nhm\n</think>\n\n42", ("\nhm\n", "\n\n42")),
    ("qwen3", "<|im_start|>assistant\n", "42", ("", "42")),
    ("qwen3", "<|im_start|>assistant\n", "4</think>2", ("", "4</think>2")),  # no thinking was opened
    ("qwen3", "<think>\n\n</think>\n\n", "42", ("", "42")),  # enable_thinking false closes it in the prompt
    ("qwen3", "<|im_start|>assistant\n<think>\n", "hm</think>42", ("hm", "42")),  # the template opened it
    ("qwen3", "<|im_start|>assistant\n", "<thin", ("", "<thin")),  # a tag that never was
    # Seed-OSS's tags; its thinking-budget notes are thinking too
    ("seed_oss", "<seed:bos>assistant\n", "<seed:think>hm<seed:cot_budget_reflect>12 left</seed:cot_budget_reflect>"
     "</seed:think>42", ("hm<seed:cot_budget_reflect>12 left</seed:cot_budget_reflect>", "42")),
    ("seed_oss", "<seed:bos>assistant\n", "<think>a</think>42", ("", "<think>a</think>42")),
    ("seed_oss", "<seed:bos>assistant\n<seed:think>", "hm</seed:think>42", ("hm", "42")),
])
def test_the_thinking_is_read_apart(name, prompt_tail, text, expected):
    assert new_parser(name, prompt_tail).whole(text) == expected


PIECES = ["<think>", "</think>", "<seed:think>", "</seed:think>", "<", "</", "seed:", "th", "ink", ">", "a", "b",
          "\n", "é"]


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(REASONING_PARSERS), opened=st.booleans(),
       text=st.lists(st.sampled_from(PIECES), max_size=12).map("".join), cuts=st.lists(st.integers(0, 60)))
def test_streamed_deltas_add_up_to_the_whole(name, opened, text, cuts):
    open_tag, close_tag = TAGS[name]
    tail = open_tag + "\n" if opened else ""
    whole = new_parser(name, tail).whole(text)
    parser, reasoning, content, at = new_parser(name, tail), "", "", 0
    for cut in sorted(set(c for c in cuts if c <= len(text))) + [len(text)]:
        r, c = parser.feed(text[at:cut])
        reasoning, content, at = reasoning + r, content + c, cut
    r, c = parser.finish()
    assert (reasoning + r, content + c) == whole
    assert (reasoning + r + content + c).replace(open_tag, "").replace(close_tag, "") == \
        text.replace(open_tag, "").replace(close_tag, "")  # nothing but the tags lost


def test_prompt_opens_thinking_reads_the_last_tag():
    assert prompt_opens_thinking("x<think>\n") and not prompt_opens_thinking("<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("plain")


THOUGHT = "<think>The user wants a number.</think>It is 42."


class ThinkingEngine(FakeEngine):
    script = THOUGHT


def test_served_chat_splits_reasoning_from_content_streamed_and_not(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)

    async def factory(on_stats):
        return ThinkingEngine(tokenizer)

    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    with TestClient(create_app(factory, tokenizer, GatewayConfig("tiny", reasoning_parser="qwen3"))) as client:
        message = client.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]
        with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as resp:
            deltas = [e["choices"][0]["delta"] for e in sse_events(resp) if e["choices"]]
    assert (message["reasoning"], message["content"]) == ("The user wants a number.", "It is 42.")
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    plain = TestClient(create_app(factory, tokenizer, GatewayConfig("tiny")))
    with plain:  # without --reasoning-parser: the text as the model wrote it
        message = plain.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]
    assert message["content"] == THOUGHT and "reasoning" not in message


class ThinkingCaller(FakeEngine):
    max_model_len = 1024  # the tools' prompt is long in the tiny vocabulary
    script = '<think>Weather: ask the tool.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_tool_calls_are_read_from_the_content_after_the_thinking(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)

    async def factory(on_stats):
        return ThinkingCaller(tokenizer)

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    request = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 400,
               "tools": tools}
    config = GatewayConfig("tiny", reasoning_parser="deepseek_r1")
    with TestClient(create_app(factory, tokenizer, config)) as client:
        choice = client.post("/v1/chat/completions", json=request).json()["choices"][0]
    assert choice["message"]["reasoning"] == "Weather: ask the tool."
    [call] = choice["message"]["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city": "Paris"}')
    assert choice["message"]["content"] is None  # (the fake engine ends on length: no "tool_calls" reason)
