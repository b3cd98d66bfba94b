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

from services.gateway.errors import CLIENT_LEFT, GatewayError, error_body, status_of
from services.gateway.answer import Answer, prepend
from services.gateway.sse import sse_event
from services.gateway.parsers.tool import ToolCall
from services.gateway.responses_api.request import chat_messages_of
from shared.messages import StoredResponse

_json = msgspec.json.Encoder()


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
