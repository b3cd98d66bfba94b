"""OpenAI's /v1/embeddings: each input's vector, from the engine's last-token pooling
(SamplingParams.embed: the final hidden state at the prompt's last token, L2-normalized,
as vLLM pools decoder models for its embed task).

Each input is one engine request that computes its prompt and ends with a placeholder
token (nothing is sampled for it, and it is not shown); the inputs of a batch run side by side, in any worker's batch beside
generation. Usage counts prompt tokens only, as OpenAI's does.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request

from services.gateway.answer import end_span, request_log
from services.gateway.errors import BadRequest, raise_for_engine_error, status_of
from services.gateway.generation import Usage, generate
from services.gateway.protocol import EmbeddingRequest, parse_body, prompt_batch
from shared.sampling_params import embedding_params
from shared.tracing import inject

if TYPE_CHECKING:
    from services.gateway.serving import OpenAIServing

MAX_INPUTS = 2048  # OpenAI's bound on one request's batch
ENCODINGS = ("float", "base64")


async def embeddings(serving: OpenAIServing, request: Request) -> dict:
    span, ctx = serving.request_span(request)
    try:
        body = await _answer(serving, parse_body(await serving.read_body(request), EmbeddingRequest), ctx)
    except Exception as exc:
        end_span(span, status_of(exc), exc)
        raise
    end_span(span, 200)
    return body


async def _answer(serving: OpenAIServing, body: EmbeddingRequest, ctx) -> dict:
    serving.check_model(body.model)
    if serving.config.unsupported_pooling is not None:
        raise BadRequest(serving.config.unsupported_pooling, "model")
    if body.encoding_format not in ENCODINGS:
        raise BadRequest(f"encoding_format must be one of {', '.join(ENCODINGS)}", "encoding_format")
    if body.dimensions is not None:
        # vLLM's answer too: cutting a vector that was not trained for it (matryoshka) would
        # return poor embeddings without a word.
        raise BadRequest("dimensions is not supported: this model's embeddings are not matryoshka", "dimensions")
    if body.truncate_prompt_tokens == 0:
        raise BadRequest("truncate_prompt_tokens must be -1 (the context) or at least 1", "truncate_prompt_tokens")
    prompts = await serving.encode(prompt_batch(body.input, "input", MAX_INPUTS), ctx, "input")
    # No max_tokens: the one position after the prompt is all an embedding needs of the context.
    prompts = await serving.fit_context(prompts, body.truncate_prompt_tokens, None, "input")
    usage = Usage()
    vectors: dict[int, list[float]] = {}
    params = embedding_params()
    request_id = f"embd-{uuid.uuid4().hex}"
    async for deltas in generate(serving.client, serving.tokenizer.backend, request_id, prompts,
                                 params, serving.tokenizer.eos_token_id, usage, serving.config.idle_timeout_s,
                                 trace_headers=inject(ctx), incremental=False,
                                 lora_request=serving.lora_of(body.model)):
        for delta in deltas:
            raise_for_engine_error(delta)
            if delta.pooled is not None:
                vectors[delta.index] = delta.pooled
    if len(vectors) != len(prompts):  # a worker that answered without the vector: never silent
        raise RuntimeError(f"{len(prompts) - len(vectors)} of {len(prompts)} embeddings did not come back")
    data = [{"object": "embedding", "index": i, "embedding": _encode(vectors[i], body.encoding_format)}
            for i in range(len(prompts))]
    num_tokens = sum(map(len, prompts))
    # Counted as the other endpoints' requests are: its prompt tokens, one finished request
    # an input (ended as asked: "stop"), its latency; it generates nothing.
    e2e = time.monotonic() - usage.started_at
    serving.metrics.request_finished(num_tokens, ["stop"] * len(prompts), None, [], e2e, usage.queue_time_s)
    request_log.info("request finished", extra={"request_id": request_id, "status": 200, "prompt_tokens": num_tokens,
                                                "cached_tokens": usage.cached_tokens, "e2e_s": round(e2e, 4)})
    return {"object": "list", "data": data, "model": serving.response_model(body.model),
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
