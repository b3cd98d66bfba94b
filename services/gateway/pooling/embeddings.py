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

from services.gateway.sse import end_span, request_log
from services.gateway.errors import BadRequest, raise_for_engine_error, status_of
from services.gateway.generation import Usage, generate
from services.gateway.protocol import EmbeddingRequest, parse_body
from services.gateway.engine_params import prompt_batch
from shared.sampling_params import embedding_params
from shared.tracing import inject

if TYPE_CHECKING:
    from services.gateway.serving import OpenAIServing

MAX_INPUTS = 2048  # OpenAI's bound on one request's batch
ENCODINGS = ("float", "base64")


async def embeddings(serving: OpenAIServing, request: Request) -> dict:
    return await answered(serving, request, EmbeddingRequest, _answer)


async def answered(serving: OpenAIServing, request: Request, kind: type, answer) -> dict:
    """The body parsed as `kind` and answered by `answer(serving, body, ctx)` (a whole JSON
    answer: embeddings, scores), the request's span ended either way."""
    span, ctx = serving.request_span(request)
    try:
        body = await answer(serving, parse_body(await serving.read_body(request), kind), ctx)
    except Exception as exc:
        end_span(span, status_of(exc), exc)
        raise
    end_span(span, 200)
    return body


async def _answer(serving: OpenAIServing, body: EmbeddingRequest, ctx) -> dict:
    if body.encoding_format not in ENCODINGS:
        raise BadRequest(f"encoding_format must be one of {', '.join(ENCODINGS)}", "encoding_format")
    if body.dimensions is not None:
        # vLLM's answer too: cutting a vector that was not trained for it (matryoshka) would
        # return poor embeddings without a word.
        raise BadRequest("dimensions is not supported: this model's embeddings are not matryoshka", "dimensions")
    vectors, num_tokens = await embed(serving, prompt_batch(body.input, "input", MAX_INPUTS), body.model,
                                      body.truncate_prompt_tokens, ctx, "input", "embd")
    data = [{"object": "embedding", "index": i, "embedding": _encode(vector, body.encoding_format)}
            for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": serving.response_model(body.model),
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def embed(serving: OpenAIServing, inputs: list[str | list[int]], model: str | None,
                truncate_prompt_tokens: int | None, ctx, field: str, kind: str,
                classify: bool = False) -> tuple[list[list[float]], int]:
    """Each input's vector, in order, and the prompt tokens they took: the engine requests of
    /v1/embeddings, /score and /rerank, and with `classify` /classify's (a classifier's
    vectors are its score head's logits) (`field`: the inputs' name in a 400; `kind`: the
    request id's prefix and the log's)."""
    serving.check_model(model)
    if classify and serving.config.classifier is None:
        raise BadRequest("this model is not a sequence classifier (no *ForSequenceClassification in its config): "
                         "/classify has nothing to give", "model")
    if not classify and serving.config.classifier is not None:
        raise BadRequest("this model is a sequence classifier: /classify gives its classes; it has no embeddings",
                         "model")
    if serving.config.unsupported_pooling is not None and not classify:
        raise BadRequest(serving.config.unsupported_pooling, "model")
    if truncate_prompt_tokens == 0:
        raise BadRequest("truncate_prompt_tokens must be -1 (the context) or at least 1", "truncate_prompt_tokens")
    prompts = await serving.encode(inputs, ctx, field)
    # No max_tokens: the one position after the prompt is all an embedding needs of the context.
    prompts = await serving.fit_context(prompts, truncate_prompt_tokens, None, field)
    usage = Usage()
    vectors: dict[int, list[float]] = {}
    params = embedding_params()
    request_id = f"{kind}-{uuid.uuid4().hex}"
    async for deltas in generate(serving.client, serving.tokenizer.backend, request_id, prompts,
                                 params, serving.tokenizer.eos_token_id, usage, serving.config.idle_timeout_s,
                                 trace_headers=inject(ctx), incremental=False,
                                 lora_request=serving.lora_of(model)):
        for delta in deltas:
            raise_for_engine_error(delta)
            if delta.pooled is not None:
                vectors[delta.index] = delta.pooled
    if len(vectors) != len(prompts):  # a worker that answered without the vector: never silent
        raise RuntimeError(f"{len(prompts) - len(vectors)} of {len(prompts)} embeddings did not come back")
    num_tokens = sum(map(len, prompts))
    # Counted as the other endpoints' requests are: its prompt tokens, one finished request
    # an input (ended as asked: "stop"), its latency; it generates nothing.
    e2e = time.monotonic() - usage.started_at
    serving.metrics.request_served(list(map(len, prompts)), ["stop"] * len(prompts), e2e, usage.queue_time_s)
    request_log.info("request finished", extra={"request_id": request_id, "status": 200, "prompt_tokens": num_tokens,
                                                "cached_tokens": usage.cached_tokens, "e2e_s": round(e2e, 4)})
    return [vectors[i] for i in range(len(prompts))], num_tokens


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
