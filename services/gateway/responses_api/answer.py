"""OpenAI's Responses API (`POST /v1/responses`), over the chat path.

A Responses request is turned into the chat request it means — `instructions` a system
message, `input` items messages (`function_call` items an assistant's tool calls,
`function_call_output` items tool messages), `text.format` a response_format, the flat
function tools chat's nested ones — and served as a chat is: the same validation,
template, sampling, reasoning and tool-call parsers. Only the answer's shape differs:
output items (a `reasoning` item with --reasoning-parser, a `message` with `output_text`,
a `function_call` per call), and for a stream the API's typed events, from
`response.created` to `response.completed`, the last carrying the same response a
request sent whole gets.

A response is stored unless `store` is false (OpenAI's default; store.py keeps
it): `previous_response_id` goes on from a stored one — its conversation, input and
output, then this request's input, under this request's instructions alone, as OpenAI
does — and `GET`/`DELETE /v1/responses/{id}` read and drop one (`/input_items`:
items.py).

With `include: ["message.output_text.logprobs"]` (or `top_logprobs`) the output text
carries its tokens' logprobs, chat's entries; streamed, each text delta those of the
tokens since the one before (a reasoning parser's thinking and a call's tokens among them).

`reasoning.effort` is chat's `reasoning_effort` (the template's variable, as vLLM's). The
thinking comes whole, as the reasoning item's content, so `reasoning.summary` has nothing
to shorten: the item's `summary` stays empty. `include: ["reasoning.encrypted_content"]`
(what a client sends that keeps no state on the server: Codex, with `store: false`) gives
the item `encrypted_content`, the thinking's text in base64 — not encrypted, as nothing
here needs hiding from the client that asked; sent back as input, a reasoning item is
dropped whatever it holds, as chat templates drop a past turn's thinking.

Not implemented, so refused by name: other `include`s, `background`, `conversation`,
`prompt`, and input that is not text. `tools: []` is no tools (as OpenAI takes it; the
Agents SDK always sends the list, and `include`).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import Response

from services.gateway.errors import CLIENT_LEFT, BadRequest, GatewayError, NotFound, error_body, status_of
from services.gateway.protocol import ChatCompletionRequest, Int
from services.gateway.answer import Answer, prepend
from services.gateway.sse import sse_event
from services.gateway.parsers.tool import ToolCall
from shared.messages import StoredResponse

_json = msgspec.json.Encoder()


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


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"{where}.content must be text (a string or input_text/output_text parts)", "input")


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
                             "content": _text_of(item.get("content"), where)})
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


class ResponsesAnswer(Answer):
    """A chat's generation, answered as a Response (n is always 1 here)."""

    ID_PREFIX = "resp_"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _response(self, status: str, reasoning: str, content: str, calls: list[ToolCall],
                  finish: str | None, logprobs: list | None = None) -> dict[str, Any]:
        # In progress (a stream's `response.created`): no output yet, each item comes with
        # its `output_item.added` (the openai client's stream refuses an index seen twice).
        output: list[dict[str, Any]] = []
        if status != "in_progress":
            if reasoning:
                output.append(self._reasoning_item(reasoning, "completed"))
            if content or not calls:
                output.append(self._message_item(content, "completed", logprobs))
            output += [self._call_item(call, "completed") for call in calls]
        incomplete = finish == "length"
        if status == "completed" and incomplete:
            status = "incomplete"
        u = self.usage
        body = self.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "model": self.model, "output": output,
            "instructions": body.instructions, "max_output_tokens": self.params.max_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else (
                {"type": "function", "name": body.tool_choice.function.name} if body.tool_choice else "auto"),
            "tools": [{"type": "function", **msgspec.to_builtins(t.function)} for t in body.tools or []],
            "text": {"format": body.text_format or {"type": "text"}}, "truncation": "disabled",
            "reasoning": body.reasoning,
            "store": body.store, "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
            "usage": {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
                      "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u.prompt_tokens + u.completion_tokens},
        }

    @staticmethod
    def _text_part(text: str, logprobs: list | None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [],
                **({"logprobs": logprobs} if logprobs is not None else {})}

    def _message_item(self, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
        content = [self._text_part(text, logprobs)] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        item = {"type": "reasoning", "id": self.reasoning_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}
        if self.body.encrypted_reasoning and status == "completed":
            item["encrypted_content"] = base64.b64encode(text.encode()).decode()
        return item

    @staticmethod
    def _call_item(call: ToolCall, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
                "name": call.name, "arguments": call.arguments if status == "completed" else "", "status": status}

    async def _collect(self) -> Response:
        gathered = await self._gather()
        if gathered is None:
            return Response(b"{}", status_code=CLIENT_LEFT, media_type="application/json")
        reasoning, content, calls = self._message(0, gathered.texts[0])
        logprobs = self._logprobs(0, gathered.logprobs[0])["content"] if self.params.logprobs is not None else None
        body = self._response("completed", reasoning or "", content or "", calls, gathered.finish[0], logprobs)
        return Response(self._kept(body), media_type="application/json")

    def _kept(self, response: dict[str, Any]) -> bytes:
        """A finished response's JSON, stored first where the request asks."""
        encoded = _json.encode(response)
        if self.body.store:
            conversation = self.body.conversation() + chat_messages_of(response["output"])
            self.s.responses.store.put(self.response_id, StoredResponse(encoded, _json.encode(conversation)))
        return encoded

    def _event(self, kind: str, **fields) -> bytes:
        self.sequence += 1
        return sse_event(_json.encode({"type": kind, "sequence_number": self.sequence, **fields}), kind)

    async def _sse(self, first) -> AsyncIterator[bytes]:
        self.sequence = -1
        status, failure = CLIENT_LEFT, None
        reasoning, content, calls = "", "", []  # what has gone out, to close the items with
        items: dict[str, int] = {}  # item id -> output_index, in the order they opened
        finish = None
        # With logprobs: the tokens' since the last text delta, and all of them
        logprobs, pending = ([], []) if self.params.logprobs is not None else (None, None)
        try:
            yield self._event("response.created", response=self._response("in_progress", "", "", [], None))
            yield self._event("response.in_progress", response=self._response("in_progress", "", "", [], None))
            async for deltas in prepend(first, self.stream):
                for d in deltas:
                    finish = str(d.finish_reason) if d.finish_reason is not None else finish
                    if logprobs is not None and d.logprobs:
                        entries = self._logprobs(0, d.logprobs)["content"]
                        logprobs += entries
                        pending += entries
                    more_reasoning, more_content, call_deltas = self._parse_delta(d)
                    new_calls = [ToolCall(c.id, c.name or "", "") for c in call_deltas if c.id is not None]
                    arguments = [(c.index, c.arguments) for c in call_deltas if c.arguments]
                    if more_reasoning:
                        if self.reasoning_id not in items:
                            items[self.reasoning_id] = len(items)
                            yield self._event("response.output_item.added", output_index=items[self.reasoning_id],
                                              item=self._reasoning_item("", "in_progress"))
                        reasoning += more_reasoning
                        yield self._event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                          output_index=items[self.reasoning_id], content_index=0,
                                          delta=more_reasoning)
                    if more_content:
                        if self.message_id not in items:
                            items[self.message_id] = len(items)
                            yield self._event("response.output_item.added", output_index=items[self.message_id],
                                              item=self._message_item("", "in_progress"))
                            yield self._event("response.content_part.added", item_id=self.message_id,
                                              output_index=items[self.message_id], content_index=0,
                                              part={"type": "output_text", "text": "", "annotations": []})
                        content += more_content
                        yield self._event("response.output_text.delta", item_id=self.message_id,
                                          output_index=items[self.message_id], content_index=0, delta=more_content,
                                          logprobs=pending or [])
                        if pending:
                            pending = []
                    for call in new_calls:
                        calls.append(call)
                        item = self._call_item(call, "in_progress")
                        items[item["id"]] = len(items)
                        yield self._event("response.output_item.added", output_index=items[item["id"]], item=item)
                    for index, fragment in arguments:
                        call = calls[index]
                        call.arguments += fragment
                        item_id = self._call_item(call, "completed")["id"]
                        yield self._event("response.function_call_arguments.delta", item_id=item_id,
                                          output_index=items[item_id], delta=fragment)
            if reasoning:
                yield self._event("response.reasoning_text.done", item_id=self.reasoning_id,
                                  output_index=items[self.reasoning_id], content_index=0, text=reasoning)
                yield self._event("response.output_item.done", output_index=items[self.reasoning_id],
                                  item=self._reasoning_item(reasoning, "completed"))
            if content or not calls:
                if self.message_id not in items:  # (an empty answer still has its message)
                    items[self.message_id] = len(items)
                    yield self._event("response.output_item.added", output_index=items[self.message_id],
                                      item=self._message_item("", "in_progress"))
                index = items[self.message_id]
                yield self._event("response.output_text.done", item_id=self.message_id, output_index=index,
                                  content_index=0, text=content, logprobs=logprobs or [])
                yield self._event("response.content_part.done", item_id=self.message_id, output_index=index,
                                  content_index=0, part=self._text_part(content, logprobs))
                yield self._event("response.output_item.done", output_index=index,
                                  item=self._message_item(content, "completed", logprobs))
            for call in calls:
                item = self._call_item(call, "completed")
                yield self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=items[item["id"]], arguments=call.arguments)
                yield self._event("response.output_item.done", output_index=items[item["id"]], item=item)
            done = self._response("completed", reasoning, content, calls, finish, logprobs)
            # (the JSON it is stored as goes out as it is: encoded once)
            yield self._event("response.completed", response=msgspec.Raw(self._kept(done)))
            status = 200
        except GatewayError as exc:
            status, failure = status_of(exc), exc
            error = msgspec.json.decode(error_body(exc))["error"]
            yield self._event("error", code=str(error["code"]), message=error["message"], param=error["param"])
        finally:
            self._finished(status, failure)
