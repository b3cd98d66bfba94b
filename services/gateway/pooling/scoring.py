"""vLLM's /score (and /v1/score) and /rerank (/v1/rerank, /v2/rerank, Jina's and Cohere's
shape): over an embedding model each distinct text embedded once, as /v1/embeddings embeds
it, each pair scored by cosine similarity; over a cross-encoder (a classifier of one
label) each pair through it, encoded together (shared/processing/scoring.py); rerank's documents
sorted by their score against the query, the first top_n kept."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from fastapi import Request

from services.gateway.pooling.embeddings import MAX_INPUTS, answered, embed
from services.gateway.errors import BadRequest
from shared.processing.scoring import cosine, pair_token_ids, score_pairs

if TYPE_CHECKING:
    from services.gateway.serving import OpenAIServing

Truncation = Annotated[int, msgspec.Meta(ge=-1)]


class ScoreRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str | None = None
    text_1: str | list[Any]
    text_2: str | list[Any]
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: every document
    return_documents: bool = True  # Cohere's: each result with its document's text
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None


async def score(serving: OpenAIServing, request: Request) -> dict:
    return await answered(serving, request, ScoreRequest, _score)


async def rerank(serving: OpenAIServing, request: Request) -> dict:
    return await answered(serving, request, RerankRequest, _rerank)


async def _scores(serving: OpenAIServing, text_1, text_2, body, ctx, kind: str) -> tuple[list[float], int]:
    classifier = serving.config.classifier
    if classifier is not None and not classifier.cross_encoder:
        raise BadRequest(f"this model is a classifier of {len(classifier.labels)} labels, not a cross-encoder "
                         "(one label): /classify gives its classes", "model")
    try:
        texts, pairs = score_pairs(text_1, text_2, MAX_INPUTS)
        if classifier is not None:  # a cross-encoder: each pair through it, encoded together
            # (the gateway's tokenizer: a text pair is not a request the tokenizer replicas take)
            together = [pair_token_ids(serving.tokenizer.hf, texts[a], texts[b]) for a, b in pairs]
    except ValueError as exc:
        message = str(exc)
        raise BadRequest(message, message.split()[0]) from exc
    if classifier is not None:
        logits, num_tokens = await embed(serving, together, body.model, body.truncate_prompt_tokens, ctx, "text_2",
                                         kind, classify=True)
        return [classifier.probabilities(row)[0] for row in logits], num_tokens
    vectors, num_tokens = await embed(serving, texts, body.model, body.truncate_prompt_tokens, ctx, "text_2", kind)
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], num_tokens


async def _score(serving: OpenAIServing, body: ScoreRequest, ctx) -> dict:
    scores, num_tokens = await _scores(serving, body.text_1, body.text_2, body, ctx, "score")
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": serving.response_model(body.model),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def _rerank(serving: OpenAIServing, body: RerankRequest, ctx) -> dict:
    if not body.documents:
        raise BadRequest("documents must not be empty", "documents")
    scores, num_tokens = await _scores(serving, body.query, body.documents, body, ctx, "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": body.documents[i]}}
                                                              if body.return_documents else {})} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": serving.response_model(body.model), "results": results,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
