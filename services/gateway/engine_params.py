"""A parsed request's fields as the engine takes them: its prompts, its SamplingParams
(structured outputs, logit bias, the model's defaults), and the checks that need more
than a field's type (beam search's fields, chat options, messages)."""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.errors import BadRequest
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.tokenizer.tokenizer import ChatOptionError, chat_messages, check_chat_options
from shared.sampling_params import SamplingParams, StructuredOutputsParams


MAX_PROMPTS = 64  # one completions request's batch


# What a beam search takes of a request (beside the prompt's own fields): the rest, set,
# would be silently ignored, so it is a 400
BEAM_SEARCH_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "ignore_eos", "temperature",
    "length_penalty", "include_stop_str_in_output", "use_beam_search", "user", "metadata", "store", "service_tier",
    "safety_identifier", "prompt_cache_key", "modalities",
    "request_id", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "add_special_tokens",
    "truncate_prompt_tokens", "priority", "cache_salt", "reasoning_effort", "documents", "spaces_between_special_tokens",
})


def check_beam_search(request: CompletionRequest | ChatCompletionRequest) -> None:
    """length_penalty only with use_beam_search; with it, no field it does not take."""
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise BadRequest("length_penalty is taken with use_beam_search only", "length_penalty")
        return
    for info in msgspec.structs.fields(request):
        if info.name not in BEAM_SEARCH_FIELDS and getattr(request, info.name) != info.default:
            raise BadRequest(f"{info.name} is not taken with use_beam_search (a beam search answers whole, "
                             "with its n best beams)", info.name)


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request, as OpenAI takes them: a string, a list of token
    ids, or a batch of either (LangChain's client sends its batches that way)."""
    return prompt_batch(request.prompt, "prompt")


def prompt_batch(prompt: Any, field: str, limit: int = MAX_PROMPTS) -> list[str | list[int]]:
    """A string, a list of token ids, or a batch of 1 to `limit` of either (`field`: its
    name in a 400)."""
    if isinstance(prompt, str) or (prompt and all(_is_token_id(t) for t in prompt)):
        return [_one_prompt(prompt, field)]
    if not prompt or len(prompt) > limit:
        raise BadRequest(f"{field} must be a string, token ids, or a batch of 1 to {limit} of them", field)
    return [_one_prompt(p, field) for p in prompt]


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _one_prompt(prompt: Any, field: str = "prompt") -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(f"{field} must not be empty", field)
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return list(prompt)
    raise BadRequest(f"each {field} must be a non-empty string or a non-empty list of token ids", field)


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest, structured_outputs: StructuredOutputsParams | None = None,
    defaults: dict | None = None,
) -> SamplingParams:
    """`structured_outputs`: the request's, from `structured_outputs_of` (the caller also
    needs the field it came from). `defaults`: the model's, for fields the request leaves
    out (shared/hf/generation_config.py)."""
    defaults = defaults or {}
    check_beam_search(request)
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None and request.stream:
        raise BadRequest("prompt_logprobs cannot be streamed (as vLLM's); echo with logprobs can", "prompt_logprobs")
    if isinstance(request, ChatCompletionRequest):
        if request.modalities not in (None, ["text"]):
            raise BadRequest(f"modalities {request.modalities!r}: llmbus answers with text only", "modalities")
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    else:
        max_tokens, logprobs = request.max_tokens, request.logprobs
        # OpenAI's echo with logprobs: the echoed prompt's tokens have theirs too.
        if request.echo and prompt_logprobs is None:
            prompt_logprobs = logprobs
        if request.echo and max_tokens == 0:  # the prompt alone (scored): one token sampled, not shown
            max_tokens = 1
    if request.truncate_prompt_tokens == 0:
        raise BadRequest("truncate_prompt_tokens must be -1 (the context) or at least 1", "truncate_prompt_tokens")
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options needs stream: true", "stream_options")
    if request.n > 16:
        raise BadRequest(f"n must be at most 16, got {request.n}", "n")
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != request.n:
        raise BadRequest(f"best_of must equal n ({request.n}), got {best_of}: drawing more choices than are "
                         "returned is not supported", "best_of")
    fields: dict[str, Any] = dict(
        n=request.n,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        seed=request.seed,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=list(request.stop_token_ids or []),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        logit_bias=_logit_bias(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=list(request.bad_words or []),
        structured_outputs=structured_outputs,
        prompt_logprobs=prompt_logprobs,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(request, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        message = str(exc)
        raise BadRequest(message, message.split()[0]) from exc


def structured_outputs_of(request) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (for a 400 that names it)."""
    given = {}
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            given["response_format"] = dict(json_object=True)
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise BadRequest("response_format json_schema needs json_schema.schema", "response_format")
            given["response_format"] = dict(json=fmt.json_schema.schema)
        else:
            raise BadRequest(f"response_format type must be text, json_object or json_schema, got {fmt.type!r}",
                             "response_format")
    if request.structured_outputs is not None:
        unknown = sorted(set(request.structured_outputs) - set(StructuredOutputsParams.__struct_fields__))
        if unknown:  # (vLLM's other keys - structural_tag, whitespace options - are not implemented)
            raise BadRequest(f"structured_outputs.{unknown[0]} is not supported by llmbus (it takes json, "
                             "json_object, regex, choice, grammar)", f"structured_outputs.{unknown[0]}")
        given["structured_outputs"] = request.structured_outputs
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(request, field) is not None:
            given[field] = {key: getattr(request, field)}
    if not given:
        return None, None
    if len(given) > 1:
        raise BadRequest(f"give one constraint, not {' and '.join(given)}", list(given)[1])
    (field, spec), = given.items()
    try:  # convert, not construct: the types are checked as the wire's decoder will
        return msgspec.convert(spec, StructuredOutputsParams), field
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise BadRequest(f"{field}: {exc}", field) from exc


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit():
            raise BadRequest(f"logit_bias keys are token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def validate_chat_options(request) -> None:
    """A chat's (or a chat /tokenize's) template options, before they reach a tokenizer."""
    if request.add_special_tokens:
        raise BadRequest("add_special_tokens must be false for messages: the chat template adds the special "
                         "tokens it wants", "add_special_tokens")
    try:
        check_chat_options(request.add_generation_prompt, request.continue_final_message,
                           request.chat_template_kwargs)
        msgspec.msgpack.encode(request.chat_template_kwargs)  # what goes to the tokenizer must fit the wire
    except ChatOptionError as exc:
        raise BadRequest(str(exc), exc.field) from exc
    except (OverflowError, TypeError) as exc:
        raise BadRequest(f"chat_template_kwargs cannot be sent on: {exc}", "chat_template_kwargs") from exc


def validate_messages(messages: list[dict[str, Any]], images: bool = False) -> list[dict[str, Any]]:
    """Chat messages as OpenAI defines them (the tokenizer's chat_messages), checked before
    they are sent on: the messages as a template reads them; with image parts (media.py's
    {"type": "image"}), as they are, for the tokenizer replica to place the images."""
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    try:
        msgspec.msgpack.encode(messages)  # what goes to the tokenizer must fit the wire
    except (OverflowError, TypeError) as exc:
        raise BadRequest(f"messages cannot be sent on: {exc}", "messages") from exc
    try:
        converted = chat_messages(messages, "" if images else None)
        return messages if images else converted
    except ChatOptionError as exc:
        raise BadRequest(str(exc), exc.field) from exc
