"""vLLM's synthetic rejection sampling (`"rejection_sample_method": "synthetic"`), a
benchmarking knob: each draft is accepted with a set probability given that those before
it were, instead of being checked against the target's sample, so a run's speed can be
read at a chosen acceptance length whatever the drafter's quality (a random-weight model
on a GPU lease). The accepted drafts are emitted as they are, then the target's sample at
the position after them: the text is not the model's (it is where the drafter is the
target itself). A request under a grammar is verified as ever (its tokens must stay in the
grammar).
"""

from __future__ import annotations

import logging

import numpy as np

from shared.config import SpeculativeConfig

log = logging.getLogger("llmbus.worker")


def rates_for_length(length: float, k: int) -> list[float]:
    """One conditional rate p at every position, with a mean acceptance length of `length`
    tokens a drafting step (the drafts accepted and the token after them) when k drafts
    are proposed: p + p^2 + ... + p^k = length - 1, found by bisection (its left side
    rises with p from 0 to k)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        if sum(p ** j for j in range(1, k + 1)) < length - 1:
            low = p
        else:
            high = p
    return [(low + high) / 2] * k


class SyntheticAcceptance:
    def __init__(self, config: SpeculativeConfig, seed: int = 0) -> None:
        k = config.num_speculative_tokens
        self.rates = config.synthetic_acceptance_rates or rates_for_length(config.synthetic_acceptance_length, k)
        self.random = np.random.default_rng(seed)
        log.warning("synthetic acceptance (a benchmarking setting): drafts are accepted at rates %s, not checked: "
                    "the text generated is not the model's", [round(r, 3) for r in self.rates])

    def num_accepted(self, num_drafts: int) -> int:
        draws = self.random.random(num_drafts)
        accepted = 0
        while accepted < num_drafts and draws[accepted] < self.rates[accepted]:
            accepted += 1
        return accepted
