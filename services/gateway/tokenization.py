"""vLLM's /tokenize, /detokenize and /tokenizer_info: what a prompt costs in tokens, and
what ids read as.

Clients count a prompt's tokens before sending it (to fit the context, to budget) and
turn ids back into text. A prompt is encoded by a tokenizer replica exactly as a
completion's is — a conversation through the same chat template, tools included — so the
count is the one the engine will see; ids are decoded here, by the gateway's tokenizer
(special tokens kept, as vLLM does). lm-evaluation-harness's remote tokenizer uses all
three (/tokenizer_info only where --enable-tokenizer-info-endpoint serves it, as vLLM's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from fastapi import Request

from services.gateway.errors import BadRequest, Unavailable
from services.gateway.engine_params import validate_chat_options, validate_messages
from services.gateway.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizePromptRequest, parse_body
from services.gateway.tools import tool_choice_of
from shared.messages import TokenizeRequest

if TYPE_CHECKING:
    from services.gateway.serving import OpenAIServing


async def tokenize(serving: OpenAIServing, request: Request) -> dict:
    raw = await serving.read_body(request)
    try:  # a conversation or a prompt, as the body's fields say
        fields = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        fields = None  # parse_body names the error
    chat = isinstance(fields, dict) and "messages" in fields
    body = parse_body(raw, TokenizeChatRequest if chat else TokenizePromptRequest)
    serving.check_model(body.model)
    if chat:
        body.messages = validate_messages(body.messages)
        validate_chat_options(body)
        tools = tool_choice_of(body)
        wire = TokenizeRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                               tools=tools.tools if tools is not None else None,
                               continue_final_message=body.continue_final_message,
                               chat_template_kwargs=body.chat_template_kwargs)
    else:
        wire = TokenizeRequest(prompt=body.prompt, add_special_tokens=body.add_special_tokens)
    token_ids = await serving.tokenize(wire)
    return {
        "count": len(token_ids),
        "max_model_len": await _max_model_len(serving),
        "tokens": token_ids,
        "token_strs": serving.tokenizer.hf.convert_ids_to_tokens(token_ids) if body.return_token_strs else None,
    }


async def detokenize(serving: OpenAIServing, request: Request) -> dict:
    body = parse_body(await serving.read_body(request), DetokenizeRequest)
    serving.check_model(body.model)
    vocab = serving.tokenizer.backend.get_vocab_size(True)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})", "tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def tokenizer_info(tokenizer) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's class, its special tokens and its chat
    template (a client that tokenizes for itself renders chats with it)."""
    hf = tokenizer.hf
    info = {"tokenizer_class": type(hf).__name__, "chat_template": hf.chat_template,
            "model_max_length": hf.model_max_length}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(hf, name)  # None where the tokenizer has none
    return info


async def _max_model_len(serving: OpenAIServing) -> int | None:
    """The scheduler's, once a worker has joined (it is the workers' to know); None before."""
    try:
        info = await serving.client.scheduler_info()
    except Unavailable:
        return None
    return info.max_model_len if info.num_workers >= 1 else None
