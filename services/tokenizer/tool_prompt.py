"""Tools in the prompt for a model whose chat template knows nothing of them (SmolLM2's).

Hermes' conventions, written as plain messages that the model's own template then renders:
the tools' signatures in the system message inside `<tools></tools>`, each call the
assistant made as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in its content,
and each tool's answer as `<tool_response>...</tool_response>` in a user turn. Rewriting
messages rather than shipping a ChatML template of our own keeps every model's special
tokens its own: a template file would be right for ChatML models only.
`services/gateway/parsers/tool/` reads back what the model writes in this format.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_INSTRUCTIONS = (
    "You may call functions to answer. Their signatures, one JSON object per line, are "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write its name and arguments as one JSON object inside "
    "<tool_call></tool_call>:\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def arguments_of(call: dict[str, Any]) -> Any:
    """A call's arguments as an object: OpenAI sends them as a JSON string, templates
    (and our own prompt) write them as JSON."""
    arguments = call.get("function", {}).get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def with_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that renders tools itself: HF templates expect `arguments` as a dict."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c.get("function", {}), "arguments": arguments_of(c)}} for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation as plain system/user/assistant messages in Hermes' format."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            response = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):  # one user turn for a run of answers
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
        elif role == "assistant" and m.get("tool_calls"):
            calls = [
                "<tool_call>\n" + json.dumps({"name": c.get("function", {}).get("name"), "arguments": arguments_of(c)},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"]
            ]
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": "\n".join([content, *calls] if content else calls)})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_responses", None)
    if tools:
        prompt = TOOL_INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
