"""Beam search as vLLM runs it: outside the engine, one token a step for every live beam.

Each step asks the engine for one token of every beam with `2 * beam_width` logprobs (the
engine's own distribution, whatever the temperature), so each beam offers its most likely
continuations: an EOS among them completes the beam (unless `ignore_eos`), the rest extend
it, and the `beam_width` best of all extensions live on, best by cumulative logprob over
length ** length_penalty (the prompt counted in the length, an ending EOS not). After
`max_tokens` steps the live beams join the completed ones and the `beam_width` best are
the answer. The prefix cache makes each step's prompts, one token longer than the last
step's, cost a token each.

`BeamSearch` is the bookkeeping alone; `LLM.beam_search` and the gateway's
`use_beam_search` drive it with their own engine calls: each step's batch from
`step_batch`, its candidates back through `advance_each`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import Logprob
from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # an ending EOS kept in the beam's tokens

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def step_params(self) -> SamplingParams:
        """One engine request's: one token, and the candidates' logprobs."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True)


@dataclass(slots=True)
class BeamSearchSequence:
    """vLLM's: `tokens` the prompt's and the beam's."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per generated token: its candidates'
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(beam.tokens)
    if eos_token_id is not None and beam.tokens and beam.tokens[-1] == eos_token_id:
        length -= 1
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int | None = None) -> None:
        self.params = params
        self.eos = eos_token_id
        self.prompt_len = len(prompt_token_ids)
        self.max_model_len = max_model_len  # (the live beams, all one length, stop at the context)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        full = self.max_model_len is not None and self.prompt_len + self.steps >= self.max_model_len
        return self.steps >= self.params.max_tokens or not self.live or full

    def pending(self) -> list[list[int]]:
        """The token ids of each live beam: this step's prompts."""
        return [beam.tokens for beam in self.live]

    def advance(self, step_logprobs: list[dict[int, Logprob] | None]) -> None:
        """Each live beam's step (in `pending`'s order): its candidates' logprobs, by token id
        (vLLM's shape: `Logprobs.by_token`, an offline output's)."""
        extended = []
        for beam, position in zip(self.live, step_logprobs, strict=True):
            if position is None:  # (the engine gave no token: the beam cannot go on)
                continue
            candidates = {token_id: lp.logprob for token_id, lp in position.items()}
            for token_id, logprob in candidates.items():
                step = [*beam.logprobs, candidates]
                if token_id == self.eos and not self.params.ignore_eos:
                    tokens = beam.tokens + [token_id] if self.params.include_stop_str_in_output else beam.tokens
                    self.completed.append(BeamSearchSequence(tokens, step, beam.cum_logprob + logprob,
                                                             finish_reason="stop", stop_reason=token_id))
                else:
                    extended.append(BeamSearchSequence(beam.tokens + [token_id], step, beam.cum_logprob + logprob))
        extended.sort(key=self._score, reverse=True)
        self.live = extended[: self.params.beam_width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The answer: the `beam_width` best of the completed and the live beams."""
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.live, key=self._score, reverse=True)
        return ranked[: self.params.beam_width]

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos, self.params.length_penalty)


def step_batch(searches: list[BeamSearch]) -> tuple[list[BeamSearch], list[list[int]]]:
    """(the searches still going, and one step's prompts: every live beam of each, in order)."""
    live = [search for search in searches if not search.done]
    return live, [ids for search in live for ids in search.pending()]


def advance_each(live: list[BeamSearch], step_logprobs: list[dict[int, Logprob] | None]) -> None:
    """Each search advanced by its beams' share of one step's batch (`step_batch`'s order)."""
    at = 0
    for search in live:
        share = len(search.live)  # (before advancing, which replaces its beams)
        search.advance(step_logprobs[at:at + share])
        at += share
