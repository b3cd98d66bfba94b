"""OpenAI's `GET /v1/responses/{id}/input_items`: the items a stored response was generated
from — as OpenAI lists them for a conversation chained by previous_response_id, the earlier
turns' inputs and answers too — paged by `limit` (1-100, 20), `order` (desc, the newest
first, or asc) and `after` (the id of the last item of the page before).

The store keeps a response's conversation as the chat messages its prompt was rendered
from (store.py); each becomes the item it was sent as: a message (input text,
or an assistant's output text), a function call, a function call's output. Their ids are
derived from the response's id and their place, the same at every read (a page's cursor).
A past turn's reasoning, which the prompt left out, is not among them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from services.gateway.errors import BadRequest
from services.gateway.responses_api.request import chat_messages_of
from shared.messages import StoredResponse


def input_items(response_id: str, stored: StoredResponse, query: dict[str, str]) -> dict[str, Any]:
    for name in query:
        if name not in ("limit", "order", "after", "include"):  # (include: no item here has those fields)
            raise BadRequest(f"{name} is not supported by llmbus here (it takes limit, order and after)", name)
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be an integer from 1 to 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be asc or desc", "order")
    conversation = msgspec.json.decode(stored.conversation)
    # (its output items as the messages they were stored as: what to leave off the end)
    output = chat_messages_of(msgspec.json.decode(stored.response).get("output") or [])
    items = [item for i, message in enumerate(conversation[:len(conversation) - len(output)])
             for item in _items(message, f"{response_id}:{i}")]
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise BadRequest(f"after names no item of this response: {after!r}", "after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _id(prefix: str, where: str) -> str:
    return f"{prefix}_{hashlib.sha256(where.encode()).hexdigest()[:32]}"


def _items(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content") or ""
    if role == "tool":
        return [{"type": "function_call_output", "id": _id("fco", where), "call_id": message.get("tool_call_id"),
                 "output": content, "status": "completed"}]
    items = []
    if content or not message.get("tool_calls"):
        part = ({"type": "output_text", "text": content, "annotations": []} if role == "assistant"
                else {"type": "input_text", "text": content})
        items.append({"type": "message", "id": _id("msg", where), "role": role, "content": [part],
                      "status": "completed"})
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        items.append({"type": "function_call", "id": _id("fc", f"{where}:{j}"), "call_id": call.get("id"),
                      "name": function.get("name"), "arguments": function.get("arguments", ""),
                      "status": "completed"})
    return items
