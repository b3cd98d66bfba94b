"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from shared.messages import Logprob

# vLLM's: a position's logprobs, token id -> Logprob (the sampled token's and the top-k's)
PositionLogprobs = dict[int, Logprob]

T = TypeVar("T")


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None  # per generated token, when asked for

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(position[token_id].logprob for token_id, position in zip(self.token_ids, self.logprobs))


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # L2-normalized


@dataclass(slots=True)
class PoolingRequestOutput(Generic[T]):
    """What a pooling call (`LLM.embed`, `LLM.classify`) returns for a prompt, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: T
    finished: bool = True


@dataclass(slots=True)
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """`LLM.embed`'s."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (vLLM's
    # shape), filled in with the first output token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    embedding: list[float] | None = None  # an embedding request's (SamplingParams.embed)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # per class, as the model's problem_type has them (shared/hf/classification.py)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """`LLM.classify`'s."""


@dataclass(slots=True)
class ScoringOutput:
    score: float  # the cosine similarity of the pair's embeddings, or a cross-encoder's output on the pair


@dataclass(slots=True)
class ScoringRequestOutput:
    """What `LLM.score` returns for a pair, shaped like vLLM's (its prompt token ids: the
    first text's, then the second's)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
