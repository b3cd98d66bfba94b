"""The worker's state for one request it holds between steps."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from shared.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + output known to the worker
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    # A constrained request's xgrammar GrammarMatcher, or its compile still under way.
    matcher: object | Future | None = None
    # longrope (Phi-3): its tokens rotate with the long factors (it was past the threshold
    # when this worker got it; the scheduler restarts one that crosses it)
    long_rope: bool = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
