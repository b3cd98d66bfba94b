"""A Responses API request (`POST /v1/responses`), and the chat request it means:
`instructions` a system message, `input` items messages, `text.format` a response_format,
the flat function tools chat's nested ones (answer.py serves it as a chat)."""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.errors import BadRequest, NotFound
from services.gateway.protocol import ChatCompletionRequest, Int
from shared.messages import StoredResponse


class ResponsesTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "text", "json_object" or "json_schema"
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None


class ResponsesReasoning(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    effort: str | None = None  # chat's reasoning_effort
    summary: str | None = None  # "auto", "concise", "detailed": the thinking comes whole, never summarized
    generate_summary: str | None = None  # (summary's older name)


class ResponsesChat(ChatCompletionRequest, kw_only=True):
    """The chat a Responses request means, with what its response echoes back."""

    instructions: str | None = None
    text_format: dict[str, Any] | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # (echoed)
    encrypted_reasoning: bool = False  # include reasoning.encrypted_content

    def conversation(self) -> list[dict[str, Any]]:
        """Its messages but the instructions' (which a response going on from it leaves out)."""
        return self.messages[1:] if self.instructions is not None else self.messages


class ResponsesRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto", "required", {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    stream: bool = False
    store: bool | None = None  # left out: true (OpenAI's default)
    previous_response_id: str | None = None
    truncation: str | None = None  # "disabled" only
    metadata: dict[str, Any] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None  # (bookkeeping, as on chat)
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # (bookkeeping: how long OpenAI keeps a cached prefix)
    max_tool_calls: Int | None = None  # a cap on built-in tools' calls, of which there are none here
    include: list[str] | None = None  # INCLUDABLE
    top_logprobs: Int | None = None
    cache_salt: str | None = None  # vLLM's, as on chat
    request_id: str | None = None  # vLLM's: the response is `resp_<id>` (request_ids.py)

    # A chat request's field, as the client named it here (for a 400's param).
    PARAMS = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens",
              "max_tokens": "max_output_tokens", "logprobs": "include", "reasoning_effort": "reasoning"}
    INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")

    def to_chat(self, storing: bool, previous: StoredResponse | None = None) -> ResponsesChat:
        """`storing`: whether this server stores responses; `previous`: the stored response
        previous_response_id names, None where no gateway holds it."""
        if self.store and not storing:
            raise BadRequest("this server stores no responses (--responses-store-mb 0): leave store out or set it "
                             "false", "store")
        if self.truncation not in (None, "disabled"):
            raise BadRequest("truncation must be disabled: llmbus does not drop input to fit the context",
                             "truncation")
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        if self.previous_response_id is not None:
            if previous is None:
                raise NotFound(f"Previous response with id '{self.previous_response_id}' not found.",
                               "previous_response_id", "previous_response_not_found")
            messages += msgspec.json.decode(previous.conversation)
        messages += chat_messages_of(self.input)
        chat: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "instructions": self.instructions, "store": self.store is not False and storing,
                                "previous_response_id": self.previous_response_id}
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("parallel_tool_calls", self.parallel_tool_calls),
                            ("user", self.user), ("metadata", self.metadata), ("cache_salt", self.cache_salt),
                            ("request_id", self.request_id)):
            if value is not None:
                chat[name] = value
        for extra in self.include or ():
            if extra not in self.INCLUDABLE:
                raise BadRequest(f"include {extra!r} is not supported by llmbus (it includes "
                                 f"{', '.join(self.INCLUDABLE)})", "include")
        if "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs is not None:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        chat["encrypted_reasoning"] = "reasoning.encrypted_content" in (self.include or ())
        if self.reasoning is not None:
            chat["reasoning"] = msgspec.to_builtins(self.reasoning)
            if self.reasoning.effort is not None:
                chat["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            chat["tools"] = [{"type": t.type, "function": {
                k: v for k, v in msgspec.structs.asdict(t).items() if k != "type" and v is not None}} for t in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if isinstance(choice, dict):
                if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                    raise BadRequest("tool_choice must be none, auto, required or {\"type\": \"function\", "
                                     "\"name\": ...}", "tool_choice")
                choice = {"type": "function", "function": {"name": choice["name"]}}
            chat["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            chat["text_format"] = msgspec.to_builtins(fmt)
        if fmt is not None and fmt.type != "text":
            chat["response_format"] = ({"type": "json_schema", "json_schema": {
                "name": fmt.name or "", "schema": fmt.schema, "strict": fmt.strict}}
                if fmt.type == "json_schema" else {"type": fmt.type})
        try:
            return msgspec.convert(chat, ResponsesChat)
        except msgspec.ValidationError as exc:
            raise BadRequest(str(exc)) from exc


def _content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as a chat message's: its text, or, with `input_image`
    parts, chat parts (text, and image_url for each image: media.py reads them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        parts = []
        for j, part in enumerate(content):
            if part.get("type") in ("input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
                parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            else:
                raise BadRequest(f"{where}.content[{j}] must be input_text, output_text or input_image with an "
                                 "image_url (file_id is not supported)", "input")
        return parts
    raise BadRequest(f"{where}.content must be a string or input_text/output_text/input_image parts", "input")


def chat_messages_of(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a model's function calls (consecutive ones in one
    assistant turn) and their outputs as tool turns; a previous turn's reasoning item is
    dropped, as chat templates drop a past turn's thinking."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role must be user, assistant, system or developer", "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise BadRequest(f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":  # (its text and its calls: one turn)
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise BadRequest(f"{where}: a function_call_output needs call_id and output (strings)", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind != "reasoning":
            raise BadRequest(f"{where}.type {kind!r} is not supported by llmbus", "input")
    return messages
