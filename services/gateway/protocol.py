"""OpenAI request bodies, parsed and validated with msgspec (engine_params.py turns them into the
engine's prompts and params)."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from services.gateway.errors import BadRequest


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
    # OpenAI's legacy completions', as vLLM takes it: only where it equals n (the n choices are
    # the best of n: nothing more is drawn), a 400 otherwise (SGLang's bench sends 1)
    best_of: Int | None = None
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
