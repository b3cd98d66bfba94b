"""Tool calls read out of generated text as it streams: what the model wrote as content,
and what it wrote as calls, each call's id and name first, then its arguments in fragments.

One parser per choice, fed the choice's text deltas. The non-streamed answer feeds its
whole text at once and assembles the same deltas, so both answers agree by construction.

- `HermesToolParser` (`--tool-call-parser hermes`, for `tool_choice: auto`): the model
  chose; calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
  (the format `services/tokenizer/tool_prompt.py` teaches), content is the text before
  the first. A block that is not a call is content.
- `RequiredToolParser` (`required`): a grammar made the text a JSON array of
  `{"name": ..., "arguments": {...}}` objects, separators fixed, name first; arguments
  stream as the model writes them.
- `NamedToolParser` (a named function): a grammar made the whole text its arguments.
- `Llama3JsonToolParser` (`llama3_json`) and `PythonicToolParser` (`pythonic`), for
  `auto` with Llama's own formats: the answer is text, or calls from its first character.
- `MistralToolParser` (`mistral`): content, then the calls after `[TOOL_CALLS]`;
  `GraniteToolParser` (`granite`) the same after Granite 3's `<|tool_call|>`.
- `Qwen3CoderToolParser` (`qwen3_coder`): hermes' blocks around Qwen3-Coder's XML-like
  calls, their values typed by the tools' schemas; `SeedOssToolParser` (`seed_oss`) the
  same calls in Seed-OSS's `<seed:tool_call>` blocks.
- `Glm45ToolParser` (`glm45`, `glm47`): hermes' blocks around GLM-4.5's calls, the name and
  then `<arg_key>`/`<arg_value>` pairs (GLM-4.7 writes no newline after the name).
- `MiniMaxM2ToolParser` (`minimax_m2`): `<minimax:tool_call>` blocks of one or more
  `<invoke name="...">` calls, their `<parameter name="...">` values typed as qwen3_coder's.
- `DeepSeekV3ToolParser` (`deepseek_v3`, and `deepseek_v31`: `DeepSeekV31ToolParser`): one
  `<｜tool▁calls▁begin｜>` block of calls after the content, each name then its arguments
  (in a json fence for V3 and R1, bare for V3.1); `KimiK2ToolParser` (`kimi_k2`): Kimi K2's
  block, its calls keeping the model's own ids.
- `HarmonyToolParser` (`openai`): gpt-oss's calls, messages to `functions.NAME` (harmony.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from services.gateway.parsers.harmony import HarmonyStream
from services.gateway.parsers.reasoning_parsers import _partial_suffix


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # which of the choice's calls
    id: str | None = None  # id and name come once, on a call's first delta
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolCallParser(Protocol):
    num_calls: int

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_whole(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole text's content and calls: the stream's deltas, assembled."""
    parsed = parser.feed(text).add(parser.finish())
    calls: list[ToolCall] = []
    for d in parsed.tool_calls:
        if d.id is not None:
            calls.append(ToolCall(d.id, d.name or "", ""))
        calls[d.index].arguments += d.arguments
    return parsed.content, calls


class HermesToolParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"  # a call's block

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # 1 when the client asked for no parallel calls
        self.buffer = ""
        self.in_call = False
        self.space = ""  # the whitespace before the open block: dropped if it is a call
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while True:
            if self.in_call:
                at = self.buffer.find(self.CLOSE)
                if at < 0:
                    return out
                body, self.buffer = self.buffer[:at], self.buffer[at + len(self.CLOSE):]
                self.in_call = False
                self._call(body, self.OPEN + body + self.CLOSE, out)
                continue
            at = self.buffer.find(self.OPEN)
            if at >= 0:
                before = self.buffer[:at]
                self._content(before.rstrip(), out)
                self.space = before[len(before.rstrip()):]
                self.buffer, self.in_call = self.buffer[at + len(self.OPEN):], True
                continue
            # Held back: what may begin a tag, and trailing whitespace (dropped if a call
            # follows it, sent once other text does).
            head = self.buffer[:len(self.buffer) - _partial_suffix(self.buffer, self.OPEN)].rstrip()
            self._content(head, out)
            self.buffer = self.buffer[len(head):]
            return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_call:  # a call the model did not close, as small models often end
            self._call(self.buffer, self.OPEN + self.buffer, out)
        else:
            self._content(self.buffer, out)
        self.buffer, self.in_call = "", False
        return out

    def _content(self, text: str, out: ParsedDelta) -> None:
        # Text after the first call is not the message's content (the model's chatter
        # between calls); vLLM's hermes parser drops it too.
        if self.num_calls == 0:
            out.content += text

    def _call(self, body: str, raw: str, out: ParsedDelta) -> None:
        calls, space, self.space = self._calls(body), self.space, ""
        if not calls:
            self._content(space + raw, out)
            return
        for name, arguments, *model_id in calls:
            if self.max_calls is not None and self.num_calls >= self.max_calls:
                return  # a call beyond those asked for is neither a call nor content
            call_id = model_id[0] if model_id else new_call_id()
            out.tool_calls += [ToolCallDelta(self.num_calls, call_id, name),
                               ToolCallDelta(self.num_calls, None, None, arguments)]
            self.num_calls += 1

    def _calls(self, body: str) -> list[tuple[str, ...]]:
        """A block's calls (hermes': one), each (name, JSON arguments), or (name, arguments,
        the id the model gave it) where a format names its calls; none: not a call."""
        call = self._read(body)
        return [] if call is None else [call]

    @staticmethod
    def _read(body: str) -> tuple[str, str] | None:
        """(name, JSON arguments) of a block's body; None when it is no call."""
        return _call_of(body)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3CoderToolParser(HermesToolParser):
    """vLLM's `qwen3_coder`: Qwen3-Coder's `<tool_call>` blocks hold
    `<function=name><parameter=p>value</parameter>...</function>`, each value as written,
    typed by the tool's JSON schema (integer, number, boolean; objects and arrays as JSON;
    null) into the JSON arguments; a parameter the schema does not name stays a string."""

    reads_schemas = True

    def __init__(self, max_calls: int | None = None, tools: dict[str, dict] | None = None) -> None:
        super().__init__(max_calls)
        self.tools = tools or {}  # function name -> its parameters' JSON schema

    def _read(self, body: str) -> tuple[str, str] | None:
        function = _FUNCTION.fullmatch(body.strip() + ("" if "</function>" in body else "</function>"))
        if function is None:
            return None
        name = function.group(1).strip()
        types = self._types(name)
        arguments = {key.strip(): _typed(value, types.get(key.strip()))
                     for key, value in _PARAMETER.findall(function.group(2))}
        return name, json.dumps(arguments, ensure_ascii=False)

    def _types(self, name: str) -> dict[str, object]:
        """Each parameter's JSON-schema type, by the tool's schema (none for a tool it lacks)."""
        properties = (self.tools.get(name) or {}).get("properties") or {}
        return {key: (schema or {}).get("type") for key, schema in properties.items()}


class SeedOssToolParser(Qwen3CoderToolParser):
    """vLLM's `seed_oss`: Qwen3-Coder's calls in Seed-OSS's own blocks."""

    OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"


class Glm45ToolParser(Qwen3CoderToolParser):
    """vLLM's `glm45` (and `glm47`): a `<tool_call>` block holds the function's name, then
    `<arg_key>key</arg_key><arg_value>value</arg_value>` pairs. A value the tool's schema
    types as a string is the text as written (stripped); any other is read as JSON, then as
    a Python literal, else kept as text (vLLM's reading)."""

    def _read(self, body: str) -> tuple[str, str] | None:
        name, _, rest = body.strip().partition("<arg_key>")
        name, _, before = name.partition("\n")
        name = name.strip()
        if not name or before.strip() or any(c in name for c in "<>{}\n"):
            return None
        types = self._types(name)
        arguments = {}
        for key, value in _GLM_ARGUMENT.findall("<arg_key>" + rest if rest else ""):
            key, value = key.strip(), value.strip()
            arguments[key] = value if types.get(key) == "string" else _literal(value, value)
        return name, json.dumps(arguments, ensure_ascii=False)


class DeepSeekV3ToolParser(HermesToolParser):
    """vLLM's `deepseek_v3` (DeepSeek-V3, R1): after the content, one
    `<｜tool▁calls▁begin｜>` block of calls, each `<｜tool▁call▁begin｜>function<｜tool▁sep｜>`
    then the name and its JSON arguments in a json code fence, `<｜tool▁call▁end｜>`. The
    markers are special tokens: these requests keep them in their text."""

    keeps_special_tokens = True
    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL = re.compile(r"<｜tool▁call▁begin｜>[^<]*?<｜tool▁sep｜>([^\n<]+)\n```(?:json)?\n(.*?)\n```\s*"
                      r"(?:<｜tool▁call▁end｜>|$)", re.S)

    def _calls(self, body: str) -> list[tuple[str, ...]]:
        return [(name.strip(), arguments.strip() or "{}") for name, arguments in self.CALL.findall(body)]


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """vLLM's `deepseek_v31` (DeepSeek-V3.1): the same block, each call the name, then
    `<｜tool▁sep｜>` and its JSON arguments as written, no fence."""

    CALL = re.compile(r"<｜tool▁call▁begin｜>([^<]+?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.S)


class KimiK2ToolParser(DeepSeekV3ToolParser):
    """vLLM's `kimi_k2`: a `<|tool_calls_section_begin|>` block of calls, each
    `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`.
    The call keeps the model's id (`functions.NAME:INDEX`), as vLLM's does: Kimi's template
    renders a tool's result under that id, the form its model was trained to read."""

    OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<\s]+:\d+)\s*<\|tool_call_argument_begin\|>(.*?)"
                      r"(?:<\|tool_call_end\|>|$)", re.S)

    def _calls(self, body: str) -> list[tuple[str, ...]]:
        return [(call_id.rpartition(":")[0].removeprefix("functions."), arguments.strip() or "{}", call_id)
                for call_id, arguments in self.CALL.findall(body)]


class MiniMaxM2ToolParser(Qwen3CoderToolParser):
    """vLLM's `minimax_m2`: a `<minimax:tool_call>` block holds one or more
    `<invoke name="f">` calls, each of `<parameter name="p">value</parameter>`s, a value
    (stripped) typed by the tool's JSON schema as qwen3_coder's are."""

    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"

    def _calls(self, body: str) -> list[tuple[str, str]]:
        calls = []
        for name, inner in _INVOKE.findall(body):
            name = _unquoted(name)
            types = self._types(name)
            arguments = {}
            for key, value in _MINIMAX_PARAMETER.findall(inner):
                key = _unquoted(key)
                arguments[key] = _typed(value.strip(), types.get(key))
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return calls


_INVOKE = re.compile(r"<invoke name=([^>\n]+)>(.*?)(?:</invoke>|$)", re.S)
_MINIMAX_PARAMETER = re.compile(r"<parameter name=([^>\n]+)>(.*?)(?:</parameter>|$)", re.S)


def _unquoted(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'" else text


_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _literal(text: str, otherwise: object) -> object:
    """A value as JSON, else as a Python literal, else `otherwise`."""
    import ast

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return otherwise


def _typed(value: str, kind) -> object:
    """A parameter's text as its schema's type says (vLLM's reading); as written otherwise."""
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), "string")
    if value.strip().lower() == "null":
        return None
    text = value.strip()
    try:
        if kind in ("integer", "int"):
            return int(text)
        if kind in ("number", "float"):
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool"):
        return text.lower() == "true" if text.lower() in ("true", "false") else value
    if kind in (None, "string", "str", "text"):
        return value
    return _literal(text, value)


def _call_of(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return _call_from(value)


def _call_from(value) -> tuple[str, str] | None:
    """(name, JSON arguments) of a decoded `{"name": ..., "arguments" (or "parameters"): ...}`."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


# The head of one call in the grammar's array: separators fixed, name first; function
# names are OpenAI's [A-Za-z0-9_-], so no escapes inside it.
_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "arguments": ')


class RequiredToolParser:
    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = self.escaped = False
        self.call_start: int | None = None  # where the call object being read began
        self.args_from: int | None = None  # arguments sent up to here; None outside them
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        out = ParsedDelta()
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.call_start = self.pos - 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 2 and self.args_from is not None:  # the arguments object closed
                    self._arguments(out)
                    self.args_from = None
            elif ch == " " and self.call_start is not None and self.depth == 2 and self.args_from is None:
                head = _HEAD.fullmatch(self.text, self.call_start, self.pos)
                if head:
                    out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), head.group(1)))
                    self.num_calls += 1
                    self.call_start, self.args_from = None, self.pos
        if self.args_from is not None:
            self._arguments(out)
        return out

    def _arguments(self, out: ParsedDelta) -> None:
        if self.pos > self.args_from:
            out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=self.text[self.args_from:self.pos]))
            self.args_from = self.pos

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


class NamedToolParser:
    def __init__(self, name: str) -> None:
        self.name = name
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        out = self._start()
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self) -> ParsedDelta:
        return self._start()

    def _start(self) -> ParsedDelta:
        if self.num_calls:
            return ParsedDelta()
        self.num_calls = 1
        return ParsedDelta(tool_calls=[ToolCallDelta(0, new_call_id(), self.name)])


class _LeadingCallsParser:
    """Models whose answer is either text or, from its first character, calls alone (Llama
    3's JSON, Llama 3.2's and 4's Python list): the first character that is not space
    decides. Text streams as it comes; calls are read one whole unit at a time (`_units`)
    and announced as each completes. An answer that opened as calls but reads as none is
    content, whole; after a call, what does not read as one is dropped (as hermes' chatter)."""

    starts: tuple[str, ...] = ()  # what a calls answer opens with
    tags: tuple[str, ...] = ()  # special tokens a call may be wrapped in, when they are kept
    separators = " \t\n"  # what may come between units
    quotes = '"'  # the units' string quotes

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buffer = ""
        self.mode: str | None = None  # None (undecided), "content" or "calls"
        self.num_calls = 0
        self.read = 0  # in "calls": the buffer's units read up to here

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "content":
            out.content = text
            return out
        self.buffer += text
        if self.mode is None:
            head = self._untagged(self.buffer).lstrip()
            if not head or any(tag.startswith(head) for tag in self.tags):
                return out  # space, or the start of a tag: not yet decided
            if not head.startswith(self.starts):
                self.mode, out.content, self.buffer = "content", self.buffer, ""
                return out
            self.mode = "calls"
        self._calls(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "calls":
            self._calls(out, final=True)
        elif self.mode is None:
            out.content = self.buffer
        self.buffer = ""
        return out

    def _untagged(self, text: str) -> str:
        for tag in self.tags:
            text = text.replace(tag, "")
        return text

    def _calls(self, out: ParsedDelta, final: bool) -> None:
        text = self._untagged(self.buffer)
        for unit_calls, end in self._units(text, self.read, final):
            if unit_calls is None:  # not a call
                if self.num_calls == 0:  # the whole answer is content after all
                    self.mode, out.content, self.buffer = "content", self.buffer, ""
                    return
                self.read = len(text)
                break
            self.read = end
            for name, arguments in unit_calls:
                if self.max_calls is not None and self.num_calls >= self.max_calls:
                    break
                out.tool_calls += [ToolCallDelta(self.num_calls, new_call_id(), name),
                                   ToolCallDelta(self.num_calls, None, None, arguments)]
                self.num_calls += 1
        if final and self.num_calls == 0 and self.mode == "calls":
            out.content += self.buffer  # opened as calls, never finished one: its text

    def _units(self, text: str, start: int, final: bool):
        """Yields (the unit's calls as (name, JSON arguments), or None when it is no call;
        where it ends) for each complete unit of `text` from `start`: a bracketed value
        opening with one of `starts`."""
        pos = start
        while True:
            while pos < len(text) and text[pos] in self.separators:
                pos += 1
            if pos >= len(text):
                return
            if not text.startswith(self.starts, pos):
                yield None, len(text)
                return
            end = _balanced_end(text, pos, self.quotes)
            if end is None:
                if final:
                    yield None, len(text)
                return
            yield self._read(text[pos:end]), end
            pos = end

    def _read(self, unit: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


def _balanced_end(text: str, start: int, quotes: str) -> int | None:
    """Where the bracketed value opening at `start` closes (one past it), strings in
    `quotes` skipped with their escapes; None while it is open."""
    depth, quote, escaped = 0, None, False
    for i in range(start, len(text)):
        ch = text[i]
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in quotes:
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class Llama3JsonToolParser(_LeadingCallsParser):
    """vLLM's `llama3_json`: Llama 3.1-3.3 answer a call as `{"name": ..., "parameters":
    {...}}` (after `<|python_tag|>` where special tokens are kept), several separated by `;`."""

    starts = ("{",)
    tags = ("<|python_tag|>",)
    separators = " \t\n;"

    def _read(self, unit: str) -> list[tuple[str, str]] | None:
        call = _call_of(unit)
        return None if call is None else [call]


class PythonicToolParser(_LeadingCallsParser):
    """vLLM's `pythonic`: Llama 3.2's and 4's calls as a Python list of calls with keyword
    arguments, `[get_weather(city="Paris", days=2), get_time()]` (inside
    `<|python_start|>...<|python_end|>` where special tokens are kept); each argument a
    literal, sent as JSON."""

    starts = ("[",)
    tags = ("<|python_start|>", "<|python_end|>")
    quotes = "\"'"

    def _read(self, unit: str) -> list[tuple[str, str]] | None:
        return _python_calls(unit)


def _python_calls(source: str) -> list[tuple[str, str]] | None:
    import ast

    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError):
            return None  # (not a literal; or one JSON cannot hold: a set, bytes)
    return calls


TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser:
    """vLLM's `mistral`: content, then `[TOOL_CALLS]` (a special token: these requests keep
    them in their text, `keeps_special_tokens`) and the calls, as a JSON array of `{"name",
    "arguments"}` objects (Mistral 7B v0.3, Small 3.1), or `name[ARGS]{...}` after each tag
    (the newer tokenizers': Small 3.2, Magistral). Each call is announced once whole."""

    keeps_special_tokens = True
    tag = TOOL_CALLS  # what opens the calls

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buffer = ""
        self.in_calls = False
        self.num_calls = 0
        self.raw = ""  # the text from the tag on, until a call reads: content if none does
        self.as_content = False  # the tag led to no call: the rest is content as written

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.as_content:
            out.content = text
            return out
        self.buffer += text
        if self.in_calls and not self.num_calls:
            self.raw += text
        if not self.in_calls:
            at = self.buffer.find(self.tag)
            if at < 0:  # (held back: what may begin the tag, and the space before it)
                sent = self.buffer[:len(self.buffer) - _partial_suffix(self.buffer, self.tag)].rstrip()
                out.content, self.buffer = sent, self.buffer[len(sent):]
                return out
            before = self.buffer[:at]
            out.content, self.raw = before.rstrip(), before[len(before.rstrip()):] + self.buffer[at:]
            self.buffer, self.in_calls = self.buffer[at + len(self.tag):], True
        self._calls(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_calls:
            self._calls(out, final=True)
        else:
            out.content = self.buffer
        self.buffer = ""
        return out

    def _calls(self, out: ParsedDelta, final: bool) -> None:
        while (read := self._next(self.buffer.lstrip())) is not None:
            calls, self.buffer = read
            for call in calls:
                if call is None:
                    if not self.num_calls:  # no call after the tag: it and all after it are content
                        out.content, self.as_content = out.content + self.raw, True
                    self.buffer = ""  # (after a call: dropped, as hermes' chatter)
                    return
                if self.max_calls is None or self.num_calls < self.max_calls:
                    out.tool_calls += [ToolCallDelta(self.num_calls, new_call_id(), call[0]),
                                       ToolCallDelta(self.num_calls, None, None, call[1])]
                    self.num_calls += 1
        if final:
            if not self.num_calls and not self.as_content:  # no call after the tag (none at all, or
                out.content += self.raw  # cut short): the tag and its text are content, as vLLM's
            self.buffer = ""

    def _next(self, text: str) -> tuple[list, str] | None:
        """(the calls at the start of `text`, None for one that is not a call; the text
        after them), or None until they are whole."""
        if text.startswith(self.tag):  # (the newer format tags each call)
            text = text[len(self.tag):].lstrip()
        if text.startswith("["):  # a JSON array of calls
            if (read := _leading_json(text)) is None:
                return None
            items, end = read
            return ([_call_from(item) for item in items] if isinstance(items, list) else [None]), text[end:]
        name, _, rest = text.partition(ARGS)  # name[ARGS]{...}
        body = rest.lstrip()
        if not body or (read := _leading_json(body)) is None:
            return None
        arguments, end = read
        call = _call_from({"name": name.strip(), "arguments": arguments}) if name.strip() and arguments is not _NOT_JSON \
            else None
        return [call], body[end:]


_NOT_JSON = object()


def _leading_json(text: str) -> tuple[object, int] | None:
    """(the JSON value an object or array at the start of `text` decodes to, _NOT_JSON if
    none; where it ends), or None while it is open. Any other text is read whole."""
    end = _balanced_end(text, 0, '"') if text.startswith(("{", "[")) else len(text)
    if end is None:
        return None
    try:
        return json.loads(text[:end]), end
    except json.JSONDecodeError:
        return _NOT_JSON, end


class GraniteToolParser(MistralToolParser):
    """vLLM's `granite`: Granite 3's `<|tool_call|>` (a special token) and a JSON array of
    `{"name", "arguments"}` calls, content before it, read as mistral's first format."""

    tag = "<|tool_call|>"


class HarmonyToolParser:
    """vLLM's `openai`: gpt-oss's harmony messages to `functions.NAME` are calls, their
    bodies the arguments (harmony.py reads the messages); other messages' text is content."""

    keeps_special_tokens = True  # (its markers are special tokens: the text keeps them)

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.stream = HarmonyStream()
        self.num_calls = 0
        self.calling = False  # the open message is a call (its text: the arguments)
        self.dropping = False  # a call beyond max_calls: neither a call nor content

    def feed(self, text: str) -> ParsedDelta:
        return self._read(self.stream.feed(text))

    def finish(self) -> ParsedDelta:
        return self._read(self.stream.finish())

    def _read(self, events: list[tuple]) -> ParsedDelta:
        out = ParsedDelta()
        for event in events:
            if event[0] == "open":
                recipient = event[2]
                self.calling = recipient is not None
                if self.calling and self.max_calls is not None and self.num_calls >= self.max_calls:
                    self.calling, self.dropping = False, True
                elif self.calling:
                    name = recipient.removeprefix("functions.")
                    out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), name))
                    self.num_calls += 1
            elif event[0] == "text":
                if self.calling:
                    out.tool_calls.append(ToolCallDelta(self.num_calls - 1, arguments=event[1]))
                elif not self.dropping:
                    out.content += event[1]
            else:
                self.calling = self.dropping = False
        return out


# `--tool-call-parser`: how `tool_choice: auto` reads what the model wrote (vLLM's names).
TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                      "pythonic": PythonicToolParser, "mistral": MistralToolParser,
                                      "qwen3_coder": Qwen3CoderToolParser, "granite": GraniteToolParser,
                                      "seed_oss": SeedOssToolParser, "glm45": Glm45ToolParser,
                                      "glm47": Glm45ToolParser, "minimax_m2": MiniMaxM2ToolParser,
                                      "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser,
                                      "kimi_k2": KimiK2ToolParser}
TOOL_CALL_PARSERS["openai"] = HarmonyToolParser
