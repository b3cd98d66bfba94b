"""A chat request's tools and tool_choice: checked, and turned into what the tokenizer
renders, what the engine is constrained by, and which parser reads the answer.

- `none` (the default without tools): the tools stay out of the prompt and nothing is
  parsed, so the answer is what the same request without tools gets.
- `auto` (the default with tools): the model sees the tools and chooses; the configured
  parser (`--tool-call-parser`, hermes) reads what it wrote.
- `required` and a named function are forced by a grammar, as vLLM forces them, so they
  always parse: a JSON array of `{"name", "arguments"}` objects (one at most when
  `parallel_tool_calls` is false), or the named function's arguments object alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.errors import BadRequest
from services.gateway.parsers.tool import TOOL_CALL_PARSERS, NamedToolParser, RequiredToolParser, ToolCallParser
from shared.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolChoice:
    kind: str  # "auto", "required" or "named"
    tools: list[dict[str, Any]]  # as the client sent them: what the prompt shows
    parameters: dict[str, dict[str, Any]]  # function name -> its arguments' JSON schema
    name: str | None = None  # the named function
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        if self.kind == "named":
            return StructuredOutputsParams(json=self.parameters[self.name])
        if self.kind == "required":
            calls = [
                {"type": "object", "properties": {"name": {"enum": [name]}, "arguments": schema},
                 "required": ["name", "arguments"], "additionalProperties": False}
                for name, schema in self.parameters.items()
            ]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    def keeps_special_tokens(self, auto_parser: str) -> bool:
        """Whether the parser reads special tokens (mistral's `[TOOL_CALLS]`): the answer's
        text then keeps them, as vLLM's requests for that parser do."""
        return self.kind == "auto" and getattr(TOOL_CALL_PARSERS[auto_parser], "keeps_special_tokens", False)

    def parser(self, auto_parser: str = "hermes") -> ToolCallParser:
        if self.kind == "named":
            return NamedToolParser(self.name)
        if self.kind == "required":
            return RequiredToolParser()
        parser_class = TOOL_CALL_PARSERS[auto_parser]
        options = {"tools": self.parameters} if getattr(parser_class, "reads_schemas", False) else {}
        return parser_class(max_calls=None if self.parallel else 1, **options)


def tool_choice_of(request) -> ToolChoice | None:
    """None when no tool may be called (no tools, or `tool_choice: none`)."""
    choice = request.tool_choice
    if request.tools is not None and not request.tools:
        raise BadRequest("tools must not be empty (leave it out for none)", "tools")
    if not request.tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(request.tools):
        if tool.type != "function":
            raise BadRequest(f"tools[{i}].type must be function, got {tool.type!r}", "tools")
        name = tool.function.name
        if not _NAME.fullmatch(name):
            raise BadRequest(f"tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}",
                             "tools")
        if name in parameters:
            raise BadRequest(f"tools name the function {name!r} twice", "tools")
        parameters[name] = tool.function.parameters or _NO_PARAMETERS
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    tools = [msgspec.to_builtins(t) for t in request.tools]
    parallel = getattr(request, "parallel_tool_calls", None) is not False  # (a /tokenize body has none)
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise BadRequest(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
        return ToolChoice(choice, tools, parameters, parallel=parallel)
    if choice.type != "function" or choice.function.name not in parameters:
        raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("named", tools, parameters, choice.function.name, parallel)
