"""The answer to one completion or chat request: its deltas collected into one JSON body,
or framed as an SSE stream (serving.py prepares the request; answer.py frames the
same generation as a Responses API answer).

A stream waits for the engine's first output before its headers go out, so a request the
engine refuses still gets a real HTTP status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import Request
from fastapi.responses import Response

from services.gateway import response_bodies as r
from services.gateway.context import ServingContext
from services.gateway.engine_params import completion_prompts
from services.gateway.event_stream import EventStream
from services.gateway.errors import CLIENT_LEFT, GatewayError, error_body, status_of
from services.gateway.generation import Usage, generate
from services.gateway.parsers.reasoning import new_parser
from services.gateway.parsers.tool import parse_whole
from services.gateway.parsers.tool.base import one_per_call
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.request_ids import request_names
from services.gateway.sse import JSON, end_span, request_log, sse_event
from services.gateway.tools import ToolChoice
from shared.processing.output_processor import ChoiceDelta
from shared.tracing import inject


class Answer:
    """One request's answer: its deltas collected into a body, or framed as SSE. A batch of
    prompts has n choices for each, prompt by prompt (choice p * n + i)."""

    ID_PREFIX: str | None = None  # the response id's (None: a chat's or a completion's)

    def __init__(self, serving: ServingContext, request: Request, body, params, prompts: list[list[int]],
                 tools: ToolChoice | None, span, ctx) -> None:
        self.s = serving
        self.request = request
        self.body = body
        self.chat = chat = isinstance(body, ChatCompletionRequest)
        self.span = span
        self.params = params
        self.model = serving.response_model(body.model)  # (an adapter's name, when one was asked for)
        self.request_id, self.client_id, self.response_id = request_names(
            self.ID_PREFIX or ("chatcmpl-" if chat else "cmpl-"), request.headers, body.request_id)
        self.created = int(time.time())
        self.usage = Usage(on_tokens=serving.metrics.tokens_generated, keep_token_ids=serving.config.log_outputs)
        self.object = "chat.completion" if chat else "text_completion"
        self.stream_span = serving.tracer.start_span("gateway.stream", context=ctx)
        self.num_choices = len(prompts) * params.n
        # One tool-call parser per choice, when the request lets the model call tools.
        self.tool_parsers = [tools.parser(serving.config.tool_call_parser) for _ in range(self.num_choices)] \
            if tools is not None else None
        # One reasoning parser per choice (--reasoning-parser): its thinking apart from its content,
        # which then goes to the tool-call parser. The prompt's end says whether it opened the thinking.
        self.reasoning_parsers = None
        if chat and serving.config.reasoning_parser is not None:
            tail = serving.tokenizer.decode(prompts[0][-16:], skip_special_tokens=False)
            self.reasoning_parsers = [new_parser(serving.config.reasoning_parser, tail)
                                      for _ in range(self.num_choices)]
        self.stream = generate(
            serving.client, serving.tokenizer.backend, self.request_id, prompts, self.params,
            serving.tokenizer.eos_token_id, self.usage, serving.config.idle_timeout_s, trace_headers=inject(ctx),
            incremental=bool(body.stream),  # a body sent whole needs each text once, at its end
            priority=body.priority, lora_request=serving.lora_of(body.model), cache_salt=body.cache_salt,
        )
        # Echo: each prompt's text before its choices (as the client sent it, when it sent text).
        # With logprobs the prompt's tokens have theirs too; they come with each choice's
        # first output, so a stream sends the echo there rather than in a chunk of its own.
        # With max_tokens 0 the echo is all there is (the engine samples one token, unshown).
        self.prompt_ids = prompts
        if serving.config.log_request_inputs:
            self._log_received(body)
        self.echo_logprobs = not chat and body.echo and params.logprobs is not None
        self.echo_only = not chat and body.echo and body.max_tokens == 0
        self.echo_pending = [self.echo_logprobs] * self.num_choices
        self.text_offsets = [0] * self.num_choices  # where each choice's next token's text starts
        self.prompt_sent = [False] * self.num_choices  # (return_token_ids: a completion choice's prompt ids)
        self.echo = [""] * self.num_choices
        if not chat and body.echo:
            texts = completion_prompts(body)
            for p, token_ids in enumerate(prompts):
                # (a truncated prompt's echo is what remains of it)
                sent_whole = isinstance(texts[p], str) and body.truncate_prompt_tokens is None
                text = texts[p] if sent_whole else serving.tokenizer.decode(token_ids, skip_special_tokens=False)
                self.echo[p * params.n:(p + 1) * params.n] = [text] * params.n

    async def respond(self) -> Response:
        self.s.server_load += 1  # (until _finished: vLLM's /load)
        if self.body.stream:
            try:
                first = await self.stream.__anext__()
            except StopAsyncIteration:
                first = []
            except Exception as exc:
                self._finished(status_of(exc), exc)
                raise
            return EventStream(self._sse(first), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            response = await self._collect()
        except Exception as exc:
            self._finished(status_of(exc), exc)
            raise
        self._finished(response.status_code)
        return response

    def _finished(self, status: int, exc: BaseException | None = None) -> None:
        self.s.server_load -= 1
        usage = self.usage
        self.stream_span.set_attribute("llmbus.completion_tokens", usage.completion_tokens)
        self.stream_span.end()
        end_span(self.span, status, exc)
        e2e = time.monotonic() - usage.started_at
        if status == 200 and usage.finish_reasons:
            self.s.metrics.request_finished(usage)
        elif status == CLIENT_LEFT:
            # Its choices not finished by then end aborted: vLLM's finished_reason "abort",
            # which vLLM itself never counts (vllm-project/vllm#31503).
            aborted = ["abort"] * max(0, self.num_choices - len(usage.finish_reasons))
            self.s.metrics.request_ended(usage.prompt_tokens, usage.finish_reasons + aborted)
        line = {
            "request_id": self.request_id, "client_request_id": self.client_id, "status": status,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "cached_tokens": usage.cached_tokens,
            "ttft_s": None if usage.ttft is None else round(usage.ttft, 4), "e2e_s": round(e2e, 4),
            "finish_reason": ",".join(usage.finish_reasons) or None,
        }
        if usage.keep_token_ids:  # vLLM's --enable-log-outputs: each choice as generated, before any parser
            clip, tokenizer = self._clip, self.s.tokenizer
            line["outputs"] = [
                {"index": index, "text": clip(tokenizer.decode(choice.token_ids, skip_special_tokens=True)),
                 "token_ids": clip(choice.token_ids), "finish_reason": choice.finish_reason}
                for index, choice in sorted(usage.choices.items())]
        request_log.info("request finished", extra=line)

    def _clip(self, items):
        """A prompt's or an output's text or ids as --max-log-len lets a log line hold them."""
        n = self.s.config.max_log_len
        return items if n is None else items[:n]

    def _log_received(self, body) -> None:
        """vLLM's --enable-log-requests: the request as the engine gets it (each prompt as
        tokenized, a chat's as its template rendered it), with its sampling parameters."""
        clip, tokenizer = self._clip, self.s.tokenizer
        request_log.info("request received", extra={
            "request_id": self.request_id, "client_request_id": self.client_id, "model": body.model,
            "prompts": [{"text": clip(tokenizer.decode(ids, skip_special_tokens=False)), "token_ids": clip(ids)}
                        for ids in self.prompt_ids],
            "params": msgspec.to_builtins(self.params),
        })

    def _usage(self) -> r.UsageInfo:
        u = self.usage
        return r.UsageInfo.of(u.prompt_tokens, u.completion_tokens, u.cached_tokens)

    def _logprobs(self, index: int, items, first_token: int | None = None) -> dict | None:
        """Choice `index`'s logprobs in the endpoint's shape (a completion's text offsets
        go on from its previous chunk's)."""
        as_ids = self.body.return_tokens_as_token_ids or self.s.config.return_tokens_as_token_ids
        formatter = self.s.logprobs_as_ids if as_ids else self.s.logprobs
        if self.chat:
            return formatter.chat(items)
        logprobs, self.text_offsets[index] = formatter.completion(items, first_token, self.text_offsets[index])
        return logprobs

    def _first_prompt_token(self, index: int) -> int:
        return self.prompt_ids[index // self.params.n][0]

    async def _gather(self) -> Gathered | None:
        """Every choice's whole output once the engine is done; None when the client left
        first (its requests aborted)."""
        n = self.num_choices
        g = Gathered(list(self.echo), [None] * n, [None] * n, [[] for _ in range(n)], [[] for _ in range(n)],
                     [[] for _ in range(n)])

        async def consume():
            async for deltas in self.stream:
                for d in deltas:
                    g.prompt_logprobs[d.index] += d.prompt_logprobs
                    if not self.echo_only:
                        g.texts[d.index] += d.text
                        g.logprobs[d.index].extend(d.logprobs)
                        g.token_ids[d.index] += d.token_ids
                    if d.finish_reason is not None:
                        g.finish[d.index], g.stop_reasons[d.index] = str(d.finish_reason), d.stop_reason

        async def watch_disconnect():
            while not await self.request.is_disconnected():
                await asyncio.sleep(0.25)

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(watch_disconnect())
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer not in done:
            # The client left. The reader is inside the stream, awaiting its next output:
            # cancelled, it throws into the stream, whose cleanup aborts in the engine; the
            # stream can be closed only once the reader is out of it (aclose() of a
            # generator in use raises).
            consumer.cancel()
            await asyncio.wait({consumer})
            await self.stream.aclose()
            return None
        watcher.cancel()
        consumer.result()
        return g

    def _message(self, index: int, text: str) -> tuple[str | None, str | None, list]:
        """A chat choice's whole text as (reasoning, content, tool calls), through its parsers."""
        reasoning = None
        if self.reasoning_parsers is not None:
            reasoning, text = self.reasoning_parsers[index].whole(text)
        if self.tool_parsers is None:
            return reasoning or None, text, []
        content, calls = parse_whole(self.tool_parsers[index], text)
        return reasoning or None, content or (None if calls else ""), calls

    async def _collect(self) -> Response:
        g = await self._gather()
        if g is None:
            return Response(b"{}", status_code=CLIENT_LEFT, media_type="application/json")
        want_logprobs = self.params.logprobs is not None
        token_ids = self.body.return_token_ids
        choices = []
        for i in range(self.num_choices):
            if self.echo_logprobs:  # the echoed prompt's tokens first
                lp = self._logprobs(i, g.prompt_logprobs[i] + g.logprobs[i], self._first_prompt_token(i))
            else:
                lp = self._logprobs(i, g.logprobs[i]) if want_logprobs else None
            if self.chat:
                reasoning, content, calls = self._message(i, g.texts[i])
                message = r.ChatMessage("assistant", content, [
                    r.ToolCall(c.id, "function", r.FunctionCall(c.name, c.arguments)) for c in calls],
                    reasoning=reasoning)
                choices.append(r.ChatChoice(i, message, lp, self._finish_reason(i, g.finish[i]), g.stop_reasons[i]))
            else:
                choices.append(r.CompletionChoice(i, g.texts[i], lp, g.finish[i], g.stop_reasons[i]))
                if self.params.prompt_logprobs is not None:  # vLLM's field (echo with logprobs asks too)
                    choices[-1].prompt_logprobs = self.s.logprobs.prompt(g.prompt_logprobs[i])
                if token_ids:
                    choices[-1].prompt_token_ids = self.prompt_ids[i // self.params.n]
            if token_ids:
                choices[-1].token_ids = g.token_ids[i]
        body = r.Response(self.response_id, self.object, self.created, self.model, choices,
                          self._usage())
        if self.chat and self.params.prompt_logprobs is not None:  # vLLM's: the prompt is every choice's
            body.prompt_logprobs = self.s.logprobs.prompt(g.prompt_logprobs[0])
        if self.chat and token_ids:
            body.prompt_token_ids = self.prompt_ids[0]
        return Response(JSON.encode(body), media_type="application/json")

    def _chunk(self, choices, usage=msgspec.UNSET, prompt_token_ids=msgspec.UNSET) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = r.Chunk(self.response_id, obj, self.created, self.model, choices, usage, prompt_token_ids)
        # msgspec: UTF-8 unescaped like json.dumps(ensure_ascii=False), at a fraction of
        # its cost per chunk (one chunk per token per stream at 128 streams).
        return sse_event(JSON.encode(chunk))

    def _chunks(self, choices, usage=msgspec.UNSET, prompt_token_ids=msgspec.UNSET) -> bytes:
        """An event for each choice, as OpenAI's and vLLM's streams send them: a client
        that reads `choices[0]` of each chunk (many do, n > 1 or not) sees every choice."""
        if len(choices) == 1:
            return self._chunk(choices, usage, prompt_token_ids)
        return b"".join(self._chunk([choice], usage, prompt_token_ids if i == 0 else msgspec.UNSET)
                        for i, choice in enumerate(choices))

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        """OpenAI's `tool_calls` for a choice that ended by calling tools."""
        if reason == "stop" and self.tool_parsers is not None and self.tool_parsers[index].num_calls:
            return "tool_calls"
        return reason

    def _parse_delta(self, d: ChoiceDelta) -> tuple[str, str, list]:
        """A chat delta's (reasoning, content, tool-call deltas) through its choice's
        parsers, which give up what they held back when the choice ends."""
        reasoning, content = "", d.text
        if self.reasoning_parsers is not None:
            parser = self.reasoning_parsers[d.index]
            reasoning, content = parser.feed(d.text)
            if d.finish_reason is not None:
                more_reasoning, more_content = parser.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tool_parsers is None:
            return reasoning, content, []
        parser = self.tool_parsers[d.index]
        parsed = parser.feed(content)
        if d.finish_reason is not None:
            parsed.add(parser.finish())
        return reasoning, parsed.content, one_per_call(parsed.tool_calls)

    def _delta_choice(self, d: ChoiceDelta):
        """The chunk's entry for one choice; None when it has nothing to send yet (bytes of
        an incomplete character, or text a tool-call parser holds back)."""
        reason = None if d.finish_reason is None else str(d.finish_reason)
        token_ids = (d.token_ids if not self.echo_only else []) if self.body.return_token_ids else msgspec.UNSET
        if not self.chat:
            text, items, first = ("", [], None) if self.echo_only else (d.text, d.logprobs, None)
            if self.echo_pending[d.index]:  # its first output: the echo, held back for its logprobs
                self.echo_pending[d.index] = False
                text, items, first = self.echo[d.index] + text, d.prompt_logprobs + items, self._first_prompt_token(d.index)
            lp = self._logprobs(d.index, items, first) if items or first is not None else None
            prompt = msgspec.UNSET
            if self.body.return_token_ids and not self.prompt_sent[d.index]:
                self.prompt_sent[d.index], prompt = True, self.prompt_ids[d.index // self.params.n]
            if text or reason is not None or lp or token_ids or prompt is not msgspec.UNSET:
                return r.CompletionChoice(d.index, text, lp, reason, d.stop_reason, prompt_token_ids=prompt,
                                          token_ids=token_ids)
            return None
        lp = self._logprobs(d.index, d.logprobs) if d.logprobs else None
        reasoning, content, calls = self._parse_delta(d)
        tool_calls = None
        if self.tool_parsers is not None:
            tool_calls = [r.DeltaToolCall(c.index, c.id, "function" if c.id else None,
                                          r.DeltaFunctionCall(c.name, c.arguments)) for c in calls] or None
            reason = self._finish_reason(d.index, reason)
        if content or reasoning or tool_calls or reason is not None or lp or token_ids:
            delta = r.DeltaMessage(content=content or None, tool_calls=tool_calls, reasoning=reasoning or None)
            return r.ChatChunkChoice(d.index, delta, lp, reason, d.stop_reason, token_ids)
        return None

    async def _sse(self, first: list[ChoiceDelta]) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage) or self.s.config.force_include_usage
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        usage = None if include_usage else msgspec.UNSET  # null on every chunk but the last
        n = self.num_choices
        status, failure = CLIENT_LEFT, None  # a client that leaves mid-stream never sees the end
        try:
            if self.chat:
                yield self._chunks([r.ChatChunkChoice(i, r.DeltaMessage("assistant", ""), None, None)
                                    for i in range(n)], self._usage() if continuous else usage,
                                   self.prompt_ids[0] if self.body.return_token_ids else msgspec.UNSET)
            elif any(self.echo) and not self.echo_logprobs:
                yield self._chunks([r.CompletionChoice(i, self.echo[i], None, None) for i in range(n)],
                                   self._usage() if continuous else usage)
            deltas = first
            while True:  # (the first outputs, then the stream's: no generator between, a hop a token)
                out = [c for c in map(self._delta_choice, deltas) if c is not None]
                if out:  # (the usage so far counts the tokens of these deltas)
                    yield self._chunks(out, self._usage() if continuous else usage)
                try:
                    deltas = await anext(self.stream)
                except StopAsyncIteration:
                    break
            if include_usage:
                yield self._chunk([], self._usage())
            status = 200
        except GatewayError as exc:
            status, failure = status_of(exc), exc
            yield sse_event(error_body(exc))
        finally:
            self._finished(status, failure)
            await self.stream.aclose()  # a client that left must abort the engine request now
        yield b"data: [DONE]\n\n"


@dataclass(slots=True)
class Gathered:
    """Every choice's whole output, by choice index."""

    texts: list[str]
    finish: list[str | None]
    stop_reasons: list[int | str | None]
    logprobs: list[list]
    prompt_logprobs: list[list]  # (with each choice's first output)
    token_ids: list[list[int]]


async def prepend(first, stream):
    try:
        if first:
            yield first
        async for item in stream:
            yield item
    finally:
        await stream.aclose()  # a client that left must abort the engine request now
