"""A request as the sampler sees it at a draft position: what verification samples each
draft position with (spec_decode.logit_rows), and what a model drafter's probabilistic
drafts are drawn for (sampler.draft_ids), so both take the same draw there."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.request_state import RequestState


class DraftPosition:
    """A request as the sampler sees it at one draft position: its tokens so far plus the
    drafts before this position."""

    __slots__ = ("state", "drafts")
    matcher = None  # the request's grammar masks this position's row (GrammarBackend.mask)

    def __init__(self, state: RequestState, drafts: list[int]) -> None:
        self.state = state
        self.drafts = drafts

    @property
    def sampling_params(self):
        return self.state.sampling_params

    @property
    def eos_token_id(self):
        return self.state.eos_token_id

    @property
    def num_output_tokens(self) -> int:
        return self.state.num_output_tokens + len(self.drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.state.output_token_ids + self.drafts


def next_drafts(views, drafts: dict[str, list[int]], sampler, probabilistic: bool,
                logits: Callable[[], torch.Tensor], argmax: Callable[[], torch.Tensor]) -> list[int]:
    """Each view's next draft (a model drafter's, one row of its output each, in `views`'
    order): under draft_sample_method "probabilistic" drawn from `logits()` as the target
    would draw it there (Sampler.draft_ids: the request's own per-position draw), else
    `argmax()` — its own callable, as an EAGLE-3 head takes the argmax in its draft
    vocabulary without widening the logits to the target's."""
    if probabilistic and sampler is not None:
        return sampler.draft_ids(logits(), [DraftPosition(v.state, list(drafts[v.req_id])) for v in views]).tolist()
    return argmax().tolist()
