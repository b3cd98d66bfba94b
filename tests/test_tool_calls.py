"""Tool calling: the parsers read calls out of text however it is split into deltas, the
tokenizer renders tools and tool turns into the prompt, and the gateway answers in
OpenAI's shape (message.tool_calls, delta.tool_calls, finish_reason tool_calls), forcing
`required` and named choices with a JSON constraint and refusing what it cannot do."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.gateway.parsers.tool import (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    Glm45ToolParser,
    HermesToolParser,
    GraniteToolParser,
    KimiK2ToolParser,
    Llama3JsonToolParser,
    MiniMaxM2ToolParser,
    MistralToolParser,
    NamedToolParser,
    ParsedDelta,
    PythonicToolParser,
    Qwen3CoderToolParser,
    RequiredToolParser,
    parse_whole,
)
from services.tokenizer.tokenizer import Tokenizer
from services.tokenizer.tool_prompt import hermes_messages
from shared.config import GatewayConfig
from shared.messages import EngineCoreOutput, FinishReason, SchedulerInfo
from test_gateway import FakeEngine, gateway, sse_events, tokenizer  # noqa: F401 - a fixture

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
REQUIRED_TEXT = '[{"name": "get_weather", "arguments": {"city": "a}\\"[{b", "days": 3}}, {"name": "get_time", "arguments": {}}]'


def streamed(parser, pieces: list[str], ids: list[str] | None = None) -> tuple[str, list[tuple[str, str]], list[int]]:
    """Content, (name, arguments) per call, and the order calls were announced in; each
    call's id ours (call_...), or the model's where `ids` lists them."""
    out = ParsedDelta()
    for piece in pieces:
        out.add(parser.feed(piece))
    out.add(parser.finish())
    calls, announced = [], []
    for d in out.tool_calls:
        if d.id is not None:
            assert (d.id == ids[d.index] if ids else d.id.startswith("call_")) and d.arguments == ""
            assert d.index == len(calls)
            calls.append([d.name, ""])
            announced.append(d.index)
        else:
            calls[d.index][1] += d.arguments
    return out.content, [tuple(c) for c in calls], announced


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


# ---- parsers ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_hermes_calls_read_the_same_however_the_text_is_split(cuts):
    content, calls, _ = streamed(HermesToolParser(), splits(HERMES_TEXT, cuts))
    assert content == "Let me look."
    assert calls == [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="<>/_toolcaも \n{}\"", max_size=40), st.lists(st.integers(0, 100), max_size=6))
def test_text_without_a_call_is_content_exactly(text, cuts):
    parser = HermesToolParser()
    content, calls, _ = streamed(parser, splits(text, cuts))
    if "<tool_call>" not in text:
        assert (content, calls) == (text, [])


def test_without_parallel_calls_only_the_first_is_read():
    content, calls = parse_whole(HermesToolParser(max_calls=1), HERMES_TEXT)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather"]


def test_a_block_that_is_not_a_call_stays_content_and_an_unclosed_call_still_counts():
    assert parse_whole(HermesToolParser(), "a <tool_call>not json</tool_call>") == (
        "a <tool_call>not json</tool_call>", [])
    content, calls = parse_whole(HermesToolParser(), '<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]


# Llama 3.1-3.3's JSON calls (with the python tag kept, or not) and Llama 3.2's and 4's
# Python list: the same two calls, strings holding the other format's brackets and quotes.
LEADING_CALLS = {
    "llama3_json": (Llama3JsonToolParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a}\\"[{b", '
                                          '"days": 2}}; {"name": "get_time", "parameters": {}}'),
    "pythonic": (PythonicToolParser, '<|python_start|>[get_weather(city="a)\\"]\'(b", days=2), get_time()]'
                                     '<|python_end|>'),
}
WANT = [("get_weather", json.dumps({"city": 'a}"[{b', "days": 2})), ("get_time", "{}")]
WANT_PYTHONIC = [("get_weather", json.dumps({"city": 'a)"]\'(b', "days": 2})), ("get_time", "{}")]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(LEADING_CALLS)), st.booleans(), st.lists(st.integers(0, 10_000), max_size=12))
def test_llama_calls_read_the_same_however_the_text_is_split(name, tags_kept, cuts):
    parser_class, text = LEADING_CALLS[name]
    if not tags_kept:  # (skip_special_tokens, the default, drops them)
        text = parser_class(None)._untagged(text)
    content, calls, announced = streamed(parser_class(), splits(" \n" + text, cuts))
    assert content == "" and announced == [0, 1]
    assert calls == (WANT if name == "llama3_json" else WANT_PYTHONIC)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([Llama3JsonToolParser, PythonicToolParser, MistralToolParser, GraniteToolParser]),
       st.text(alphabet="[]{}()\"'abc =,;\n<|>_TOOLCASRG:tol", max_size=40), st.lists(st.integers(0, 100), max_size=6))
@example(MistralToolParser, "[TOOL_CALLS]", [])  # the tag and nothing after it (found by a CI run)
@example(GraniteToolParser, "x <|tool_call|>", [2])
def test_an_answer_that_does_not_read_as_calls_is_content_exactly(parser_class, text, cuts):
    """Streamed as whole, and all content where it holds no call (mistral's tags included)."""
    whole_content, whole_calls = parse_whole(parser_class(), text)
    content, calls, _ = streamed(parser_class(), splits(text, cuts))
    assert (content, calls) == (whole_content, [(c.name, c.arguments) for c in whole_calls])
    if not calls:
        assert content == text


def test_llama_parsers_take_text_and_one_call_as_asked():
    for name, (parser_class, text) in LEADING_CALLS.items():
        assert parse_whole(parser_class(), "The weather is fine {today}.") == ("The weather is fine {today}.", [])
        content, calls = parse_whole(parser_class(max_calls=1), text)  # parallel_tool_calls false
        assert content == "" and [c.name for c in calls] == ["get_weather"], name
    # Not a call: JSON without a name, a list of names, a call with a positional argument
    for parser_class, text in ((Llama3JsonToolParser, '{"city": "Paris"}'), (PythonicToolParser, "[a, b]"),
                               (PythonicToolParser, '[f("x")]'), (PythonicToolParser, "[f(x=y)]")):
        assert parse_whole(parser_class(), text) == (text, [])


# Mistral's two formats after its [TOOL_CALLS] tag: a JSON array (7B v0.3, Small 3.1), and
# name[ARGS]{...} with a tag before each call (Small 3.2, Magistral).
MISTRAL_TEXTS = ['Sure.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "a}\\"[{b", "days": 2}}, '
                 '{"name": "get_time", "arguments": {}}]',
                 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "a}\\"[{b", "days": 2}[TOOL_CALLS]get_time[ARGS]{}']


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([*((MistralToolParser, t) for t in MISTRAL_TEXTS),
                        (GraniteToolParser, MISTRAL_TEXTS[0].replace("[TOOL_CALLS]", "<|tool_call|>"))]),
       st.lists(st.integers(0, 10_000), max_size=12))
def test_mistral_and_granite_calls_read_the_same_however_the_text_is_split(parser_and_text, cuts):
    parser_class, text = parser_and_text
    content, calls, announced = streamed(parser_class(), splits(text, cuts))
    assert content == "Sure." and announced == [0, 1] and calls == WANT


QWEN3_CODER_TEXT = ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\na}\"[{b\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
GLM45_TEXT = ("Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>note</arg_key>\n<arg_value>line one\n"
              "line two</arg_value>\n<arg_key>hours</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>\n"
              "<tool_call>get_time\n</tool_call>")
MINIMAX_M2_TEXT = ('Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">\n42\n</parameter>\n'
                   '<parameter name="days">2</parameter>\n<parameter name="note">line one\nline two</parameter>\n'
                   '</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>')
# Each parser of schema-typed calls, on its models' text: a weather call and a call with no
# arguments after "Sure."; values typed by the tool's schema (days an integer) where the
# format says, note (which the schema does not name) a string.
SCHEMA_TYPED = {
    # each value as written (multi-line kept, its first and last newline not)
    "qwen3_coder": (Qwen3CoderToolParser, QWEN3_CODER_TEXT, {"city": 'a}"[{b', "days": 2, "note": "line one\nline two"}),
    # a string parameter as written (city "42" stays text), the rest read as JSON (hours a list)
    "glm45": (Glm45ToolParser, GLM45_TEXT, {"city": "42", "days": 2, "note": "line one\nline two", "hours": [1, 2]}),
    "glm47": (Glm45ToolParser, GLM45_TEXT.replace("get_weather\n<arg_key>", "get_weather<arg_key>"),  # (no newline)
              {"city": "42", "days": 2, "note": "line one\nline two", "hours": [1, 2]}),
    # both calls in one block, each value stripped
    "minimax_m2": (MiniMaxM2ToolParser, MINIMAX_M2_TEXT, {"city": "42", "days": 2, "note": "line one\nline two"}),
}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(SCHEMA_TYPED)), st.lists(st.integers(0, 10_000), max_size=12))
def test_schema_typed_calls_read_the_same_however_the_text_is_split(name, cuts):
    parser_class, text, arguments = SCHEMA_TYPED[name]
    parser = parser_class(tools={"get_weather": WEATHER["function"]["parameters"]})
    content, calls, announced = streamed(parser, splits(text, cuts))
    assert content == "Sure." and announced == [0, 1]
    assert calls == [("get_weather", json.dumps(arguments)), ("get_time", "{}")]


@pytest.mark.parametrize("kind, text, value", [
    ("integer", "42", 42), ("integer", "4.5", "4.5"), ("number", "3", 3), ("number", "2.50", 2.5),
    ("boolean", "True", True), ("boolean", "no", "no"), ("object", '{"a": [1, null]}', {"a": [1, None]}),
    ("array", "['x', 2]", ["x", 2]), (["integer", "null"], "null", None), ("string", " spaced ", " spaced "),
    ("object", "{not json", "{not json"),
])
def test_qwen3_coder_values_take_their_schema_s_type(kind, text, value):
    parser = Qwen3CoderToolParser(tools={"f": {"type": "object", "properties": {"p": {"type": kind}}}})
    _, calls = parse_whole(parser, f"<tool_call>\n<function=f>\n<parameter=p>\n{text}\n</parameter>\n</function>\n"
                                   "</tool_call>")
    assert json.loads(calls[0].arguments) == {"p": value}


@pytest.mark.parametrize("body", ['{"name": "get_time", "arguments": {}}', "", "get time\nnot a pair",
                                  "<arg_key>city</arg_key><arg_value>x</arg_value>"])
def test_a_glm45_block_that_is_no_call_stays_content(body):
    content, calls = parse_whole(Glm45ToolParser(), f"Hi <tool_call>{body}</tool_call>")
    assert (content, calls) == (f"Hi <tool_call>{body}</tool_call>", [])


DEEPSEEK_V3_TEXT = ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "a}\\"[{b", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
# Each parser of a block of calls after the content, on its models' text; Kimi K2's calls
# keep the ids the model wrote
BLOCKS_OF_CALLS = {
    "deepseek_v3": (DeepSeekV3ToolParser, DEEPSEEK_V3_TEXT, None),
    "deepseek_v31": (DeepSeekV31ToolParser, 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                     '{"city": "a}\\"[{b", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    "kimi_k2": (KimiK2ToolParser, 'Sure. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "a}\\"[{b", "days": 2}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>',
                ["functions.get_weather:0", "functions.get_time:1"]),
}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(BLOCKS_OF_CALLS)), st.lists(st.integers(0, 10_000), max_size=12))
def test_blocks_of_calls_read_the_same_however_the_text_is_split(name, cuts):
    parser_class, text, ids = BLOCKS_OF_CALLS[name]
    content, calls, announced = streamed(parser_class(), splits(text, cuts), ids)
    assert content == "Sure." and announced == [0, 1] and calls == WANT


@pytest.mark.parametrize("name", sorted(BLOCKS_OF_CALLS))
def test_a_block_of_calls_without_parallel_calls_reads_the_first_and_one_left_open_still_reads(name):
    parser_class, text, _ = BLOCKS_OF_CALLS[name]
    content, calls = parse_whole(parser_class(max_calls=1), text)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather"]
    content, calls = parse_whole(parser_class(), text[: text.rindex("<")])  # (its section's end cut off)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == WANT


def test_deepseek_v3_block_with_no_call_in_it_stays_content():
    text = "Sure.<｜tool▁calls▁begin｜>nothing<｜tool▁calls▁end｜>"
    assert parse_whole(DeepSeekV3ToolParser(), text) == (text, [])


def test_minimax_m2_without_parallel_calls_reads_the_first_of_a_block():
    content, calls = parse_whole(MiniMaxM2ToolParser(max_calls=1), MINIMAX_M2_TEXT)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather"]


def test_mistral_without_parallel_calls_reads_the_first():
    for text in MISTRAL_TEXTS:
        content, calls = parse_whole(MistralToolParser(max_calls=1), text)
        assert content == "Sure." and [c.name for c in calls] == ["get_weather"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_required_calls_stream_their_arguments_as_written(cuts):
    content, calls, announced = streamed(RequiredToolParser(), splits(REQUIRED_TEXT, cuts))
    assert content == "" and announced == [0, 1]
    assert calls == [("get_weather", '{"city": "a}\\"[{b", "days": 3}'), ("get_time", "{}")]
    assert [json.loads(args) for _, args in calls] == [item["arguments"] for item in json.loads(REQUIRED_TEXT)]


def test_a_named_call_is_announced_before_any_text_and_its_arguments_are_the_text():
    parser = NamedToolParser("get_weather")
    first = parser.feed("")
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", "")]
    assert streamed(NamedToolParser("get_weather"), ['{"ci', 'ty": "Oslo"}']) == (
        "", [("get_weather", '{"city": "Oslo"}')], [0])


# ---- the prompt ---------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


def test_tools_and_tool_turns_become_hermes_messages_for_a_template_without_tools():
    messages = hermes_messages(CONVERSATION, [WEATHER])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert json.dumps(WEATHER) in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                      "</tool_call>")
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    # A system message of the client's comes first, the tools after it.
    with_system = hermes_messages([{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]], [WEATHER])
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 2


def test_a_template_that_renders_tools_gets_them_with_arguments_as_objects(tiny_llama, tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    tokenizer = Tokenizer(tiny_llama, tool_chat_template=template)
    assert tokenizer.render_chat(CONVERSATION, False, [WEATHER]) == (
        "[get_weather]<user>Weather in Paris?<assistant>Paris<tool>sunny<tool>12:00")
    plain = Tokenizer(tiny_llama)
    assert not plain.template_renders_tools
    rendered = plain.render_chat(CONVERSATION, True, [WEATHER])
    assert '"name": "get_weather"' in rendered and "<tool_response>\nsunny" in rendered


def test_chat_template_replaces_the_models_as_vllms_flag_reads_it(tiny_llama, tmp_path):
    """--chat-template: a file, or the template on one line with its escapes read; for one
    call (LLM.chat's chat_template), the text itself. Anything else is refused by name."""
    one_line = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\\n{% endfor %}<<ü中>>"
    file = tmp_path / "chat.jinja"
    file.write_text(one_line.replace("\\n", "\n"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    expected = "<<user>>hi\n<<assistant>>yo\n<<ü中>>"
    assert Tokenizer(tiny_llama, chat_template=file).render_chat(messages, False) == expected
    assert Tokenizer(tiny_llama, chat_template=one_line).render_chat(messages, False) == expected
    plain = Tokenizer(tiny_llama)
    assert plain.render_chat(messages, False) != expected
    assert plain.render_chat(messages, False, chat_template=file.read_text()) == expected
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        Tokenizer(tiny_llama, chat_template=str(tmp_path / "missing.jinja"))


# ---- served ------------------------------------------------------------------------------


class ScriptedEngine(FakeEngine):
    """Answers every request with `text`, ending with stop."""

    text = HERMES_TEXT

    async def scheduler_info(self, max_age_s: float = 2.0) -> SchedulerInfo:
        return SchedulerInfo("s1", "tiny", 1, 8192)  # the tiny tokenizer spends many tokens on tools

    async def submit(self, request) -> None:
        self.submitted.append(request)
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)
        queue = self.queues[request.request_id]
        for i, token_id in enumerate(ids):
            queue.put_nowait(EngineCoreOutput(request.request_id, [token_id],
                                              FinishReason.STOP if i == len(ids) - 1 else None))


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}


SERVED_PARSERS = {"hermes": (HERMES_TEXT, "Let me look."),
                  "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                                  '{"name": "get_time", "parameters": {}}', None),
                  "pythonic": ('[get_weather(city="Paris", days=2), get_time()]', None),
                  "mistral": ('Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                              '"days": 2}}, {"name": "get_time", "arguments": {}}]', "Let me look."),
                  "granite": ('Let me look.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
                              '"days": 2}}, {"name": "get_time", "arguments": {}}]', "Let me look."),
                  "qwen3_coder": ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                  "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
                                  "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "Let me look."),
                  "seed_oss": ("Let me look.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                               "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</seed:tool_call>\n"
                               "<seed:tool_call>\n<function=get_time>\n</function>\n</seed:tool_call>", "Let me look."),
                  "glm45": ("Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
                            "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
                            "<tool_call>get_time\n</tool_call>", "Let me look."),
                  "minimax_m2": ('Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
                                 'Paris</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n'
                                 '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>', "Let me look."),
                  "deepseek_v3": (DEEPSEEK_V3_TEXT.replace("Sure.", "Let me look.").replace('a}\\"[{b', "Paris"),
                                  "Let me look."),
                  # gpt-oss's harmony: a commentary preamble, then messages to functions (recipient
                  # after the channel, and before it)
                  "openai": ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
                             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>'
                             "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
                             "Let me look.")}


@pytest.mark.parametrize("parser", SERVED_PARSERS)
def test_auto_answers_with_tool_calls_streamed_and_whole_alike(tokenizer, parser):
    """Each --tool-call-parser, on what its models write (hermes after some text; Llama's
    formats as the whole answer, so no content)."""
    text, want_content = SERVED_PARSERS[parser]
    engine_class = type("Scripted", (ScriptedEngine,), {"text": text})
    client, engine = gateway(tokenizer, engine_class=engine_class, config=GatewayConfig("tiny", tool_call_parser=parser))
    with client:
        whole = client.post("/v1/chat/completions", json=chat(tools=[WEATHER, TIME])).json()
        with client.stream("POST", "/v1/chat/completions", json=chat(tools=[WEATHER, TIME], stream=True)) as resp:
            events = sse_events(resp)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == want_content
    calls = [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert calls == [("function", "get_weather", '{"city": "Paris", "days": 2}'), ("function", "get_time", "{}")]
    # The stream: the same content and calls, each call's id and name before its arguments.
    deltas = [e["choices"][0] for e in events if e["choices"]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    streamed_calls: dict[int, list[str]] = {}
    for d in deltas:
        indexes = [c["index"] for c in d["delta"].get("tool_calls", [])]
        assert len(indexes) == len(set(indexes))  # one entry a call a chunk (a client may read the first alone)
        for c in d["delta"].get("tool_calls", []):
            if "id" in c:
                assert c["type"] == "function" and c["index"] not in streamed_calls
                streamed_calls[c["index"]] = [c["function"]["name"], ""]
            streamed_calls[c["index"]][1] += c["function"].get("arguments", "")
    assert content == (want_content or "")
    assert [tuple(v) for v in streamed_calls.values()] == [(name, args) for _, name, args in calls]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    # The tools reached the prompt; auto is not constrained; mistral's tag (DeepSeek's
    # markers, harmony's) is a special token, which its requests keep in their text.
    assert engine.submitted[0].sampling_params.structured_outputs is None
    assert engine.submitted[0].sampling_params.skip_special_tokens == (parser not in ("mistral", "granite", "openai",
                                                                                     "deepseek_v3"))
    assert "get_weather" in tokenizer.decode(engine.submitted[0].prompt_token_ids)


def test_required_and_named_choices_are_forced_by_a_json_constraint(tokenizer):
    client, engine = gateway(tokenizer, engine_class=ScriptedEngine)
    with client:
        client.post("/v1/chat/completions", json=chat(tools=[WEATHER, TIME], tool_choice="required",
                                                      parallel_tool_calls=False))
        client.post("/v1/chat/completions", json=chat(tools=[WEATHER, TIME], tool_choice={
            "type": "function", "function": {"name": "get_weather"}}))
    required = json.loads(engine.submitted[0].sampling_params.structured_outputs.json)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], required)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_time", "arguments": {}}] * 2):  # city is required; one call at most
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    named = json.loads(engine.submitted[1].sampling_params.structured_outputs.json)
    assert named == WEATHER["function"]["parameters"]


def test_tool_choice_none_leaves_the_tools_out(tokenizer):
    client, engine = gateway(tokenizer, engine_class=ScriptedEngine)
    with client:
        out = client.post("/v1/chat/completions", json=chat(tools=[WEATHER], tool_choice="none")).json()
        client.post("/v1/chat/completions", json=chat())
    assert out["choices"][0]["message"] == {"role": "assistant", "content": HERMES_TEXT}
    assert out["choices"][0]["finish_reason"] == "stop"
    assert engine.submitted[0].prompt_token_ids == engine.submitted[1].prompt_token_ids


def test_a_tool_round_trip_is_accepted_and_rendered(tokenizer):
    client, engine = gateway(tokenizer, engine_class=ScriptedEngine)
    with client:
        resp = client.post("/v1/chat/completions", json={"model": "tiny", "messages": CONVERSATION, "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text
    assert "<tool_response>\nsunny" in tokenizer.decode(engine.submitted[0].prompt_token_ids)


@pytest.mark.parametrize("fields, param, words", [
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "sometimes"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools", "has space"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "twice"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools", "retrieval"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strictly": True}}]),
     "tools[0].function.strictly", "not supported"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "both"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": {}}}]}]),
     "messages", "JSON string"),
])
def test_tool_requests_it_cannot_serve_are_400s_naming_the_field(tokenizer, fields, param, words):
    client, engine = gateway(tokenizer, engine_class=ScriptedEngine)
    with client:
        resp = client.post("/v1/chat/completions", json=chat(**fields))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert engine.submitted == []


def test_an_assistant_turn_s_thinking_reaches_the_template_under_the_name_it_reads(tiny_llama, tmp_path):
    """A client sends a turn's thinking back as `reasoning` (vLLM's) or `reasoning_content`;
    Qwen3's template reads `reasoning_content`, gpt-oss's `thinking` (its tool-calling turn's
    analysis channel). transformers' apply_chat_template gives each under the other names
    too: llmbus passes the fields through to it untouched."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}|{{ m.thinking or '' }}|{{ m.reasoning_content or '' }}>"
                        "{{ m.content }}{% endfor %}")
    tokenizer = Tokenizer(tiny_llama, chat_template=template)
    for field in ("reasoning", "reasoning_content", "thinking"):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", field: "hm"}]
        assert tokenizer.render_chat(messages, False) == "<user||>hi<assistant|hm|hm>yo"
