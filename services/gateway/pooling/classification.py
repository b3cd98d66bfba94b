"""vLLM's /classify (and /v1/classify) over a sequence classifier: each input's class
probabilities, from the score head's logits at its last token (pooled by the engine as
embeddings are: embeddings.embed), activated as shared/hf/classification.py says, with the
most likely class's label."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from fastapi import Request

from services.gateway.pooling.embeddings import MAX_INPUTS, answered, embed
from services.gateway.engine_params import prompt_batch

if TYPE_CHECKING:
    from services.gateway.serving import OpenAIServing


class ClassificationRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list[Any]  # a string, token ids, or a batch of either
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    user: str | None = None


async def classify(serving: OpenAIServing, request: Request) -> dict:
    return await answered(serving, request, ClassificationRequest, _classify)


async def _classify(serving: OpenAIServing, body: ClassificationRequest, ctx) -> dict:
    logits, num_tokens = await embed(serving, prompt_batch(body.input, "input", MAX_INPUTS), body.model,
                                     body.truncate_prompt_tokens, ctx, "input", "classify", classify=True)
    classifier = serving.config.classifier
    data = []
    for i, row in enumerate(logits):
        probs = classifier.probabilities(row)
        data.append({"index": i, "label": classifier.label(probs), "probs": probs, "num_classes": len(probs)})
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": serving.response_model(body.model), "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}
