"""Reasoning read out of a chat answer (--reasoning-parser): the thinking apart from the
content, the same whichever way the text is cut into deltas, and served so."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.app import create_app
from services.gateway.parsers.reasoning import REASONING_PARSERS, TAGS, new_parser, prompt_opens_thinking
from services.tokenizer.tokenizer import Tokenizer
from shared.config import GatewayConfig
from test_gateway import FakeEngine, sse_events


@pytest.mark.parametrize("name, prompt_tail, text, expected", [
    ("deepseek_r1", "", "let me see</think>42", ("let me see", "42")),
    ("deepseek_r1", "", "<think>let me see</think>42", ("let me see", "42")),
    ("deepseek_r1", "", "still thinking", ("still thinking", "")),  # never closed: max_tokens ran out
    ("minimax_m2", "]~b]ai\n", "let me see</think>\n\n42", ("let me see", "\n\n42")),  # (no opening tag)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nhm\n</think>\n\n42", ("\nhm\n", "\n\n42")),
    ("qwen3", "<|im_start|>assistant\n", "42", ("", "42")),
    ("qwen3", "<|im_start|>assistant\n", "4</think>2", ("", "4</think>2")),  # no thinking was opened
    ("qwen3", "<think>\n\n</think>\n\n", "42", ("", "42")),  # enable_thinking false closes it in the prompt
    ("qwen3", "<|im_start|>assistant\n<think>\n", "hm</think>42", ("hm", "42")),  # the template opened it
    ("qwen3", "<|im_start|>assistant\n", "<thin", ("", "<thin")),  # a tag that never was
    # GLM-4.5: as qwen3 (its template closes an empty thinking in the prompt when it is off)
    ("glm45", "<|assistant|>", "<think>hm</think>\n42", ("hm", "\n42")),
    ("glm45", "<|assistant|>\n<think></think>\n", "42", ("", "42")),
    # DeepSeek-V3.1: its template ends the prompt with <think> (thinking on) or </think> (off)
    ("deepseek_v3", "<｜Assistant｜><think>", "hm</think>42", ("hm", "42")),
    ("deepseek_v3", "<｜Assistant｜></think>", "42", ("", "42")),
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
@given(name=st.sampled_from(sorted(TAGS)), opened=st.booleans(),
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


# gpt-oss's harmony answers (harmony.py): the analysis channel is reasoning, the final and
# commentary channels content, a message to a function a call (passed on, normalized)
HARMONY_CASES = [
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     ("Think.", "Hi!")),
    ("<|channel|>final<|message|>Hi!<|return|>", ("", "Hi!")),
    ("<|channel|>analysis<|message|>cut short", ("cut short", "")),  # max_tokens ran out while thinking
    ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.f <|constrain|>json<|message|>{}<|call|>",
     ("", "Let me look.<|channel|>commentary to=functions.f<|message|>{}<|call|>")),
    ("<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{\"a\": 1}",  # recipient first, no end
     ("", '<|channel|>commentary to=functions.f<|message|>{"a": 1}<|call|>')),
    ("plain text, no harmony", ("", "plain text, no harmony")),
]


@pytest.mark.parametrize("text, expected", HARMONY_CASES)
def test_harmony_channels_are_read_apart(text, expected):
    assert new_parser("openai_gptoss", "<|start|>assistant").whole(text) == expected


HARMONY_PIECES = ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>", "assistant",
                  " to=functions.f", "<|call|>", "<|return|>", "<|constrain|>json", "<|", "|>", "<", "a", "b", "{}"]


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(HARMONY_PIECES), max_size=14).map("".join), cuts=st.lists(st.integers(0, 80)))
def test_harmony_streamed_deltas_add_up_to_the_whole(text, cuts):
    """The reasoning parser and the `openai` tool-call parser after it, however the text
    is cut: what streams is what the whole answer reads as."""
    from services.gateway.parsers.tool import HarmonyToolParser, parse_whole

    reasoning_whole, content_whole = new_parser("openai_gptoss", "").whole(text)
    want = parse_whole(HarmonyToolParser(), content_whole)
    reasoner, caller, reasoning, content, calls, at = new_parser("openai_gptoss", ""), HarmonyToolParser(), "", "", [], 0
    for cut in sorted(set(c for c in cuts if c <= len(text))) + [len(text), None]:
        r, c = reasoner.feed(text[at:cut]) if cut is not None else reasoner.finish()
        parsed = caller.feed(c) if cut is not None else caller.feed(c).add(caller.finish())
        reasoning, content, at = reasoning + r, content + parsed.content, cut
        for d in parsed.tool_calls:
            if d.name is not None:
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    assert reasoning == reasoning_whole
    assert (content, calls) == (want[0], [[c.name, c.arguments] for c in want[1]])


def harmony_tokenizer(tiny_llama, tmp_path):
    """The tiny tokenizer with harmony's markers as special tokens, as gpt-oss's are (so a
    text that skips special tokens loses them), beside a gpt-oss config."""
    import json
    import shutil

    folder = tmp_path / "oss"
    shutil.copytree(tiny_llama, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tokenizer = Tokenizer(folder)
    tokenizer.hf.add_special_tokens({"additional_special_tokens": [
        "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]})
    tokenizer.hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GptOssForCausalLM"],
                                                    "model_type": "gpt_oss"}))
    return folder


class HarmonyCaller(FakeEngine):
    max_model_len = 1024
    script = ("<|channel|>analysis<|message|>Weather: ask the tool.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def test_gpt_oss_is_served_with_harmony_s_parsers_by_default(tiny_llama, tmp_path):
    """A gpt-oss checkpoint's gateway reads harmony (vLLM's openai_gptoss and openai parsers)
    unless others were asked for; its chat answers keep their special tokens for them: the
    thinking is reasoning, the final channel content, a message to a function a call."""
    from llmbus.cli.args import gateway_config
    from llmbus.cli.main import build_parser

    folder = harmony_tokenizer(tiny_llama, tmp_path)
    config = gateway_config(build_parser().parse_args(["gateway"]), "tiny", str(folder))
    assert (config.reasoning_parser, config.tool_call_parser) == ("openai_gptoss", "openai")
    asked = gateway_config(build_parser().parse_args(["gateway", "--tool-call-parser", "pythonic"]), "tiny", str(folder))
    assert asked.tool_call_parser == "pythonic"
    tokenizer = Tokenizer(folder)
    assert tokenizer.decode(tokenizer.encode("<|end|>x", add_special_tokens=False)) == "x"  # special: skipped
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    request = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 400,
               "tools": tools}
    for engine_class, want in ((HarmonyCaller, ("Weather: ask the tool.", None, [("get_weather", '{"city": "Paris"}')])),
                               (ThinkingHarmony, ("The user greets.", "Hello there!", []))):
        engine = engine_class(tokenizer)
        if engine_class is ThinkingHarmony:  # no tools: the reasoning parser alone keeps the special tokens
            request = {k: v for k, v in request.items() if k != "tools"}

        async def factory(on_stats):
            return engine

        with TestClient(create_app(factory, tokenizer, config)) as client:
            resp = client.post("/v1/chat/completions", json=request)
            assert resp.status_code == 200, resp.text
            message = resp.json()["choices"][0]["message"]
            with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as resp:
                deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in resp.iter_lines()
                          if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        assert (message["reasoning"], message["content"], calls) == want
        assert "".join(d.get("reasoning") or "" for d in deltas) == want[0]
        assert "".join(d.get("content") or "" for d in deltas) == (want[1] or "")
        assert engine.submitted[0].sampling_params.skip_special_tokens is False


class ThinkingHarmony(FakeEngine):
    max_model_len = 1024
    script = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"
