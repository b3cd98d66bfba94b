"""OpenAI request bodies, parsed and validated with msgspec; the engine's params from them."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from services.gateway.errors import BadRequest
from services.tokenizer.tokenizer import ChatOptionError, chat_messages, check_chat_options
from shared.sampling_params import SamplingParams, StructuredOutputsParams


# Every integer field fits the wire's 64-bit integers (msgpack): a seed of 2**80 is the
# client's error, a 400 naming the field, not an encoding failure at submit.
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has the usage so far


class JsonSchemaFormat(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    name: str = ""
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "function"
    function: FunctionDefinition


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str  # "function"
    function: FunctionName


class _SamplingFields(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """A field llmbus does not implement is refused (a 400 naming it), never ignored: a
    client that asks for JSON, tools or a penalty it does not get must hear so."""

    model: str
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False  # vLLM's
    ignore_eos: bool = False
    min_tokens: Int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    # vLLM's; accepted as it changes nothing: it spaces special tokens apart in a slow
    # tokenizer's decoding, and llmbus (as vLLM's fast detokenizer) decodes with fast ones
    spaces_between_special_tokens: bool = True
    # vLLM's extra: logprobs name tokens as "token_id:{id}", for tokens that are not text.
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as OpenAI writes it, a string) -> bias
    allowed_token_ids: list[Int] | None = None  # vLLM's: sample only among these
    bad_words: list[str] | None = None  # vLLM's: words the output must not contain
    priority: Int = 0  # vLLM's: lower is served first, under --scheduling-policy priority
    # vLLM's: prefix-cache hits only from requests with the same salt (one per tenant:
    # another's cannot time a hit to learn what this one sent)
    cache_salt: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    # Structured outputs, as OpenAI spells them (response_format) and vLLM (structured_outputs,
    # and its older guided_* fields): at most one of them per request.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: names the response (`chatcmpl-<id>`) unless an X-Request-Id header does (request_ids.py)
    request_id: str | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text (what RL frameworks
    # train on); streamed, the prompt's with a choice's first chunk, each chunk's own
    return_token_ids: bool = False
    # vLLM's beam search (n beams; shared/processing/beam_search.py), answered whole; the fields it
    # takes are BEAM_SEARCH_FIELDS, any other set beside it is a 400
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # OpenAI's bookkeeping, accepted as it changes no output (safety_identifier and
    # prompt_cache_key are what OpenAI split `user` into; prefix caching needs no key here).
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: Int | None = 16
    echo: bool = False
    logprobs: Int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (BOS) around a text prompt


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: go on from the last (assistant) message
    # vLLM's; true (the tokenizer's BOS on top of the template's) is refused, as at /tokenize
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's variables (enable_thinking)
    # OpenAI's; as vLLM's, the template's variable `reasoning_effort` (a template that
    # reads it — gpt-oss's, some reasoning models' — thinks as much; others ignore it)
    reasoning_effort: str | None = None
    # vLLM's: documents for a RAG template (Granite's, Command R's: each a dict of strings,
    # "title" and "text" as those read them); a template that reads none ignores them
    documents: list[dict[str, str]] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required" or a function
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # OpenAI's: ["text"] only (no audio out)

    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's variables: chat_template_kwargs, with reasoning_effort among them
        unless they set it themselves."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        if self.reasoning_effort not in REASONING_EFFORTS:
            raise BadRequest(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # (OpenAI's)


class TokenizePromptRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's /tokenize of a prompt (`model` may be left out, as there)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class EmbeddingRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """OpenAI's /v1/embeddings: `input` a string, token ids, or a batch of either."""

    model: str | None = None
    input: str | list[Any]
    encoding_format: str = "float"  # or "base64": little-endian float32s, as OpenAI's
    dimensions: Int | None = None
    user: str | None = None  # bookkeeping, accepted as on the other endpoints
    truncate_prompt_tokens: Int | None = None  # vLLM's: keep the last k tokens (-1: the context)


class TokenizeChatRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's /tokenize of a conversation: the prompt a chat completion of it would get."""

    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # The rendered template holds the special tokens it wants; only false is implemented.
    add_special_tokens: bool = False
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # `none` leaves the tools out of the prompt
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Int]


def parse_body(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`", or
        # "Object contains unknown field `tools`"
        message = str(exc)
        named = re.match(r"Object (contains unknown|missing required) field `([^`]+)`(?: - at `\$\.(.+)`)?$", message)
        if named:  # the param as OpenAI writes it: `tools[0].function.strictly`, `prompt`
            kind, name, at = named.groups()
            field = f"{at}.{name}" if at else name
            why = "is not supported by llmbus" if kind == "contains unknown" else "is required"
            raise BadRequest(f"`{field}` {why}", field) from exc
        where = re.search(r"\$\.([A-Za-z_]+)", message)
        raise BadRequest(message, where.group(1) if where else None) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise BadRequest(f"request body is not valid UTF-8: {exc}") from exc


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


def validate_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as OpenAI defines them (the tokenizer's chat_messages), checked before
    they are sent on: the messages as a template reads them."""
    if not messages:
        raise BadRequest("messages must not be empty", "messages")
    try:
        msgspec.msgpack.encode(messages)  # what goes to the tokenizer must fit the wire
    except (OverflowError, TypeError) as exc:
        raise BadRequest(f"messages cannot be sent on: {exc}", "messages") from exc
    try:
        return chat_messages(messages)
    except ChatOptionError as exc:
        raise BadRequest(str(exc), exc.field) from exc
