"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: each prompt's `n`
best beams as its choices, answered whole (shared/processing/beam_search.py keeps the beams; each
step here is one engine batch of every live beam of every prompt, as `LLM.beam_search`).

A choice's text is its beam's tokens after the prompt, an ending EOS left out of the text
(kept in its ids with `include_stop_str_in_output`), as vLLM's; usage counts the prompts
once and the returned beams' tokens.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from services.gateway import response_bodies as r
from services.gateway.sse import JSON, end_span, request_log
from services.gateway.context import ServingContext
from services.gateway.errors import BadRequest, raise_for_engine_error, status_of
from services.gateway.generation import Usage, generate
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.request_ids import request_names
from shared.processing.beam_search import BeamSearch, BeamSearchParams, advance_each, step_batch
from shared.tracing import inject


class BeamSearchAnswer:
    def __init__(self, serving: ServingContext, request: Request, body, params, prompts: list[list[int]], tools,
                 span, ctx) -> None:
        self.s, self.body, self.prompts, self.span, self.ctx = serving, body, prompts, span, ctx
        self.chat = isinstance(body, ChatCompletionRequest)
        self.started = time.monotonic()
        self.request_id, _, self.response_id = request_names("chatcmpl-" if self.chat else "cmpl-", request.headers,
                                                             body.request_id)
        self.params = BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens or 1 << 30, ignore_eos=params.ignore_eos,
            temperature=params.temperature, length_penalty=body.length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output)

    async def respond(self) -> Response:
        self.s.server_load += 1  # (vLLM's /load)
        try:
            body = await self._search()
        except Exception as exc:
            end_span(self.span, status_of(exc), exc)
            raise
        finally:
            self.s.server_load -= 1
        end_span(self.span, 200)
        return Response(JSON.encode(body), media_type="application/json")

    async def _step(self, batch: list[list[int]], step: int, step_params, eos, usage):
        """One step's engine requests, a beam each; --max-logprobs refusing the candidates n
        beams ask for is said in the request's terms."""
        try:
            async for deltas in generate(self.s.client, self.s.tokenizer.backend, f"{self.request_id}-{step}", batch,
                                         step_params, eos, usage, self.s.config.idle_timeout_s,
                                         trace_headers=inject(self.ctx), incremental=False,
                                         priority=self.body.priority, lora_request=self.s.lora_of(self.body.model),
                                         cache_salt=self.body.cache_salt):
                yield deltas
        except BadRequest as exc:
            if "max allowed" not in str(exc):
                raise
            raise BadRequest(f"use_beam_search with n={self.params.beam_width} asks each step for "
                             f"{2 * self.params.beam_width} candidates' logprobs: {exc}", "n") from exc

    async def _search(self) -> r.Response:
        info = await self.s.client.scheduler_info()
        eos = self.s.tokenizer.eos_token_id
        searches = [BeamSearch(p, self.params, eos, info.max_model_len if info else None) for p in self.prompts]
        step_params, cached = self.params.step_params(), 0
        step = 0
        while (step_of := step_batch(searches))[0]:
            live, batch = step_of
            found = [None] * len(batch)
            usage = Usage()
            async for deltas in self._step(batch, step, step_params, eos, usage):
                for d in deltas:
                    raise_for_engine_error(d)
                    if d.logprobs:
                        found[d.index] = d.logprobs[0].by_token()
            if any(lp is None for lp in found):  # (never silent: a beam would vanish)
                raise RuntimeError("a beam search step came back without its candidates' logprobs")
            cached += usage.cached_tokens
            advance_each(live, found)
            step += 1
        choices, generated = [], 0
        for search in searches:
            for beam in search.best():
                ids = beam.tokens[search.prompt_len:]
                shown = ids[:-1] if ids and ids[-1] == eos and beam.finish_reason == "stop" else ids
                text = self.s.tokenizer.decode(shown, skip_special_tokens=True)
                generated += len(ids)
                index = len(choices)
                if self.chat:
                    choices.append(r.ChatChoice(index, r.ChatMessage("assistant", text, []), None, beam.finish_reason,
                                                beam.stop_reason))
                else:
                    choices.append(r.CompletionChoice(index, text, None, beam.finish_reason, beam.stop_reason))
        prompt_tokens = sum(map(len, self.prompts))
        # Counted as one request of its prompts' tokens, finished as its beams were
        self.s.metrics.request_served(list(map(len, self.prompts)), [c.finish_reason or "stop" for c in choices],
                                      time.monotonic() - self.started, None)
        request_log.info("request finished", extra={"request_id": self.request_id, "status": 200,
                                                    "prompt_tokens": prompt_tokens, "completion_tokens": generated,
                                                    "beam_search_steps": step})
        return r.Response(self.response_id, "chat.completion" if self.chat else "text_completion", int(time.time()),
                          self.s.response_model(self.body.model), choices,
                          r.UsageInfo.of(prompt_tokens, generated, cached))
