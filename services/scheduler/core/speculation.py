"""Speculative decoding as the scheduler sees it: whether the batch speculates this step,
how many draft slots a decoding request gets, and what landing its verified drafts does
(slots given back, vLLM's spec_decode_* counters, a request whose drafts stopped paying
taken off speculation)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.core.request import Request, RequestStatus

# A speculating request whose drafts are accepted less than this often, once it has had
# this many, stops speculating: a rejected draft costs a row of the forward for nothing.
SPEC_PROBATION_TOKENS = 32
SPEC_MIN_ACCEPTANCE = 0.2


@dataclass(slots=True)
class Speculation:
    num_speculative_tokens: int  # k: drafts a request may have verified a step (0: none)
    disable_by_batch_size: int | None  # no drafts while more requests than this run
    probation: bool = True  # a request whose drafts keep failing stops speculating
    # Cumulative counters (vLLM's spec_decode_*): steps with drafts, drafts, accepted ones,
    # and accepted ones by draft position.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def active(self, num_running: int) -> bool:
        """Whether a batch of this many running requests speculates."""
        limit = self.disable_by_batch_size
        return bool(self.num_speculative_tokens) and (limit is None or num_running <= limit)

    def draft_slots(self, request: Request, num_new: int, budget: int, max_model_len: int) -> int:
        """Draft tokens the worker may verify for a decoding request this step, the batch
        speculating (`active`): never past max_tokens or the context, none while its
        worker may still be compiling its grammar (its token may come back unsampled), none
        once its drafts stopped paying."""
        if num_new != 1 or request.num_output_placeholders or not request.speculate or request.awaiting_grammar:
            return 0
        return max(0, min(self.num_speculative_tokens, request.max_tokens - request.num_output_tokens - 1,
                          max_model_len - request.num_tokens - 1, budget - 1))

    def land(self, request: Request, slots: int, num_drafted: int, num_accepted: int) -> None:
        """The slots not filled by accepted drafts were counted as computed: give them back
        (their K/V is overwritten later; blocks are hashed from known tokens only, so no
        draft enters the prefix cache). Count, and stop speculating for a request whose
        drafts keep being rejected."""
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= slots - num_accepted
        if not num_drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        request.num_draft_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        if self.probation and request.num_draft_tokens >= SPEC_PROBATION_TOKENS and (
                request.num_accepted_tokens < SPEC_MIN_ACCEPTANCE * request.num_draft_tokens):
            request.speculate = False
