"""Hermes' `<tool_call>` blocks and the formats that nest theirs in such blocks: Qwen3-Coder's and Seed-OSS's XML-like calls, GLM-4.5's key/value pairs, MiniMax-M2's invokes (their values typed by the tools' schemas)."""

from __future__ import annotations

import json
import re

from services.gateway.parsers.streamed import partial_suffix
from services.gateway.parsers.tool.base import ParsedDelta, ToolCallDelta, call_of, new_call_id


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
            head = self.buffer[:len(self.buffer) - partial_suffix(self.buffer, self.OPEN)].rstrip()
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
        return call_of(body)


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
