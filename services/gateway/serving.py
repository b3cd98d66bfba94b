"""Serving one completion or chat request: validate and tokenize it, then hand it to its
answer (answer.py) to generate and frame.

Input is validated here, before anything reaches the engine.
"""

from __future__ import annotations

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from opentelemetry import trace

from services.gateway.beam_search_answer import BeamSearchAnswer
from services.gateway.answer import Answer
from services.gateway.context import ServingContext
from services.gateway.sse import end_span
from services.gateway.errors import BadRequest, ClientLeft, NotFound, TooLarge, Unavailable, status_of
from services.gateway.media import image_files
from services.gateway.protocol import ChatCompletionRequest, parse_body
from services.gateway.engine_params import (
    completion_prompts,
    structured_outputs_of,
    to_sampling_params,
    validate_chat_options,
    validate_messages,
)
from services.gateway.parsers.reasoning import KEEPS_SPECIAL_TOKENS
from services.gateway.request_ids import client_request_id
from services.gateway.tools import tool_choice_of
from shared.config import STRUCTURED_CHECK_TIMEOUT_S
from shared.hf.generation_config import stop_at_model_eos
from shared.messages import PromptWithImages, TokenizeRequest
from shared.sampling_params import with_bad_words_tokenized
from shared.tracing import SpanKind, inject


class OpenAIServing(ServingContext):
    """Prepares each request (parse, validate, tokenize, params) and hands it, with the
    context it was made with, to the answer that serves it."""

    async def handle(self, request: Request, kind: type, answer: type = Answer) -> Response:
        """`kind`: the body's struct (a completion, a chat, or one that becomes a chat:
        `to_chat`, the Responses API's), `answer` the class that answers it."""
        span, ctx = self.request_span(request)
        try:
            body, params, prompts, tools = await self._prepare(request, kind, ctx)
        except Exception as exc:
            if isinstance(exc, BadRequest) and hasattr(kind, "PARAMS"):  # the field as the client named it
                exc.param = kind.PARAMS.get(exc.param, exc.param)
            end_span(span, status_of(exc), exc)
            raise
        if getattr(body, "use_beam_search", False):  # (checked by protocol.check_beam_search)
            answer = BeamSearchAnswer
        return await answer(self, request, body, params, prompts, tools, span, ctx).respond()

    # ---- before the engine --------------------------------------------------------------

    async def read_body(self, request: Request) -> bytes:
        body = b""
        try:
            async for chunk in request.stream():  # also bounds bodies sent without a length
                body += chunk
                if len(body) > self.config.max_body_bytes:
                    raise TooLarge(f"request body exceeds {self.config.max_body_bytes} bytes")
        except ClientDisconnect:  # (left to Starlette, a traceback in the log for a client that went)
            raise ClientLeft("the client closed the connection while sending its request") from None
        return body

    async def tokenize(self, request: TokenizeRequest, ctx=None, **options) -> list[int]:
        with self.tracer.start_as_current_span("gateway.tokenize", context=ctx, kind=SpanKind.CLIENT) as span:
            ids = await self.client.tokenize(request, headers=inject(), **options)
            span.set_attribute("llmbus.num_tokens", len(ids))
            return ids

    async def encode(self, prompts: list[str | list[int]], ctx=None, field: str = "prompt",
                     add_special_tokens: bool = True) -> list[list[int]]:
        """Texts tokenized by a tokenizer replica; token ids checked against the vocabulary."""
        encoded = []
        vocab = self.tokenizer.backend.get_vocab_size(True)
        for prompt in prompts:
            if isinstance(prompt, str):
                encoded.append(await self.tokenize(TokenizeRequest(prompt=prompt, add_special_tokens=add_special_tokens),
                                                   ctx))
                continue
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"{field} token id {bad[0]} is outside the vocabulary", field)
            encoded.append(prompt)
        return encoded

    def check_model(self, model: str | None) -> None:
        """The base model or one of its LoRA adapters (lora_modules.py). `None`: left out,
        where a route allows that (/tokenize, as vLLM's)."""
        names = (self.config.model_name, *self.config.model_aliases)
        if model is not None and model not in names and model not in self.loras:
            served = ", ".join(f"`{m}`" for m in (*names, *(n for n, _ in self.loras.items())))
            raise NotFound(f"the model `{model}` does not exist; this server serves {served}", "model",
                           "model_not_found")

    async def _prepare(self, request: Request, kind, ctx):
        if self.client.scheduler_silent():
            raise Unavailable("the scheduler is not running")
        body = parse_body(await self.read_body(request), kind)
        if hasattr(body, "to_chat"):  # (a Responses API request: the chat it means)
            previous = body.previous_response_id
            body = body.to_chat(self.responses.store.enabled,
                                await self.responses.find(previous) if previous is not None else None)
        self.check_model(body.model)
        client_request_id(request.headers, body.request_id)  # (a bad one is a 400 before anything runs)
        spec, spec_field = structured_outputs_of(body)
        tools = tool_choice_of(body) if isinstance(body, ChatCompletionRequest) else None
        forced = tools.constraint() if tools is not None else None
        if forced is not None:
            if spec is not None:
                raise BadRequest(f"tool_choice {tools.kind} and {spec_field} both constrain the output: give one",
                                 spec_field)
            spec, spec_field = forced, "tools"
        params = stop_at_model_eos(to_sampling_params(body, spec, self.config.default_sampling),
                                   self.config.model_eos_ids, self.tokenizer.eos_token_id)
        # (a few short words: encoded here, not sent to a tokenizer replica)
        params = with_bad_words_tokenized(params, lambda word: self.tokenizer.encode(word, add_special_tokens=False))
        if isinstance(body, ChatCompletionRequest) and (
                (tools is not None and tools.keeps_special_tokens(self.config.tool_call_parser))
                or self.config.reasoning_parser in KEEPS_SPECIAL_TOKENS):  # (the parsers take them out)
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        if isinstance(body, ChatCompletionRequest):
            body.messages, images = await image_files(body.messages, self.config)  # (media.py)
            if images and getattr(body, "use_beam_search", False):
                raise BadRequest("use_beam_search does not take images", "use_beam_search")
            body.messages = validate_messages(body.messages, images=bool(images))
            validate_chat_options(body)
            prompts = [await self.tokenize(TokenizeRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                tools=tools.tools if tools is not None else None, continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.template_kwargs(), documents=body.documents, images=images,
            ), ctx)]
        else:
            prompts = await self.encode(completion_prompts(body), ctx, add_special_tokens=body.add_special_tokens)
        if spec is not None:
            # Compiled by a tokenizer replica under a timeout: a bad or runaway spec is a
            # 400 here, before any header, and never reaches a worker.
            try:
                # One attempt, waited for long enough for the replica's first spec (it starts
                # its compiling child) and its own compile timeout: asking again would only
                # compile the same spec twice.
                await self.tokenize(TokenizeRequest(structured_outputs=spec), ctx, attempts=1,
                                     timeout_s=STRUCTURED_CHECK_TIMEOUT_S)
            except BadRequest as exc:
                raise BadRequest(str(exc), spec_field) from exc
        prompts = await self.fit_context(prompts, body.truncate_prompt_tokens, params.max_tokens)
        return body, params, prompts, tools

    async def fit_context(self, prompts: list[list[int]], keep: int | None, max_tokens: int | None,
                          field: str = "prompt") -> list[list[int]]:
        """Each prompt's last `keep` tokens (left truncation, as vLLM's; -1: as many as the
        context holds beside max_tokens), checked against the context. With no worker yet
        (still loading) or none left the context is not known here: the scheduler holds
        the request until one joins and checks its length then."""
        info = await self.client.scheduler_info()
        if keep == -1:
            keep = info.max_model_len - (max_tokens or 1) if info.num_workers >= 1 else None
        if keep is not None:
            if any(isinstance(p, PromptWithImages) for p in prompts):  # (a cut could split an image)
                raise BadRequest("truncate_prompt_tokens does not cut prompts with images", "truncate_prompt_tokens")
            prompts = [token_ids[-keep:] for token_ids in prompts]
        if info.num_workers >= 1:
            for token_ids in prompts:
                _check_context(info.max_model_len, len(token_ids), max_tokens, field)
        return prompts

    def request_span(self, request: Request):
        """(span, its context): FastAPI opens the HTTP server span; this one, inside it,
        lasts until the answer's last byte and parents everything the request causes on
        the bus."""
        path = request.url.path
        span = self.tracer.start_span(
            "gateway.request", kind=SpanKind.INTERNAL,
            attributes={"http.request.method": "POST", "url.path": path, "http.route": path},
        )
        return span, trace.set_span_in_context(span)


def _check_context(context: int, num_prompt: int, max_tokens: int | None, field: str = "prompt") -> None:
    if max_tokens is not None and num_prompt + max_tokens > context:
        raise BadRequest(
            f"this model's context is {context} tokens, but the {field} has {num_prompt} tokens "
            f"and max_tokens asks for {max_tokens} more ({num_prompt + max_tokens} in all)",
            "max_tokens",
        )
    if num_prompt >= context:
        raise BadRequest(f"this model's context is {context} tokens, but the {field} has {num_prompt} tokens", field)
