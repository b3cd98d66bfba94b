"""The worker's state for one request it holds between steps."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.messages import NewRequestData
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the adapter module pulls in torch)
    from services.worker.lora.adapter import LoRAAdapter


@dataclass(slots=True, eq=False)
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + output known to the worker
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_row: int  # its row of the runner's BlockTable (block_table.py)
    num_computed_tokens: int
    # A constrained request's xgrammar GrammarMatcher, or its compile still under way.
    matcher: object | Future | None = None
    # longrope (Phi-3): its tokens rotate with the long factors (it was past the threshold
    # when this worker got it; the scheduler restarts one that crosses it)
    long_rope: bool = False
    # Tokens sampled by steps still on the device (launched, not yet finished: see
    # ModelRunner.launch), which `token_ids` does not hold yet; the latest one's place, a
    # (device tensor of a step's sampled ids, index) pair, is what the next step reads.
    num_pending: int = 0
    pending_token: tuple | None = None
    # Penalized: its (table, row) of the sampler's token counts (penalties.py), and
    # how many of token_ids are counted there.
    penalty_row: tuple | None = None
    num_counted: int = 0
    # Asked for prompt logprobs, with no output yet: one per prompt position computed so
    # far (prompt_logprobs.py); None otherwise.
    prompt_logprobs: list | None = None
    lora: LoRAAdapter | None = None  # its adapter, read (manager.py); None: the base model
    images: list = field(default_factory=list)  # its ImageFeatures, by prompt position (vision/)
    mrope: tuple | None = None  # Qwen-VL's: its prompt's positions and the shift after (vision/mrope.py)
    # SamplingParams.argmax_only, read once: a step of such requests only (most decode
    # steps) takes the sampler's and the runner's shortest path.
    argmax_only: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.argmax_only = self.sampling_params.argmax_only

    @classmethod
    def of_new(cls, new: NewRequestData, block_row: int, matcher, long_rope_threshold: int | None,
               lora: LoRAAdapter | None) -> RequestState:
        """A request new to this worker (first step, resumed, preempted, migrated)."""
        num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
        return cls(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            eos_token_id=new.eos_token_id,
            block_row=block_row,
            num_computed_tokens=new.num_computed_tokens,
            matcher=matcher,
            long_rope=long_rope_threshold is not None and num_tokens > long_rope_threshold,
            # (one with output already sent them with its first token)
            prompt_logprobs=[] if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
            else None,
            lora=lora,
            images=new.mm_features,
        )

    @property
    def num_output_tokens(self) -> int:
        """Output tokens so far, those still on the device included (seeded draws and
        min_tokens count them)."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
