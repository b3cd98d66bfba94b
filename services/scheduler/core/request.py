"""The scheduler's state for one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.scheduler.core.block_pool import BlockHash
from shared.lora_request import LoRARequest
from shared.messages import EngineCoreOutput, FinishReason, ImageFeature
from shared.sampling_params import RequestOutputKind, SamplingParams


# What the image files of a step's new requests may add up to (past one request's, which
# the gateway caps at --max-body-bytes): a step goes to its worker as one message, and the
# bus carries 8 MB at most (llmbus/deploy/nats_server.py)
STEP_IMAGE_BYTES = 4 << 20


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved against the context: never None here
    arrival_time: float = 0.0
    reply_subject: str = ""
    priority: int = 0  # with the priority policy: lower runs first
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are (or, once the in-flight step lands, will be) in the cache.
    num_computed_tokens: int = 0
    # Tokens this request will sample in steps already sent but not yet answered (async
    # scheduling): the next step may be built as if they were there.
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 before
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks so far
    # True while a worker holds this request's state: it then gets deltas, not full data.
    in_worker: bool = False
    # Constrained and sent to a worker that has not sampled for it yet: its matcher may
    # still be compiling there (the token may come back unsampled), so its next step is
    # not built until this one lands.
    awaiting_grammar: bool = False
    # Speculative decoding: drafts the worker proposed for it and how many were accepted;
    # it stops speculating once they say drafts do not pay (scheduler.SPEC_*).
    speculate: bool = True
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    # longrope (Phi-3): whether its K/V is computed with the long factors (it was longer
    # than the threshold when it started), and sampled tokens still to come from steps
    # in flight that must be dropped (computed before it restarted long).
    long_rope: bool = False
    num_discarded_tokens: int = 0
    trace_headers: dict[str, str] = field(default_factory=dict)
    # A hybrid model's prefix cache: the token counts (block boundaries, ascending) after
    # which its recurrent state is to be saved, its prefill cut at each.
    snapshot_points: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # its adapter; None: the base model
    # Prefill/decode disaggregation: prefilled on a kv_producer worker, then handed to a
    # kv_consumer to decode (Fleet.hand_off, services/scheduler/shell/fleet.py). A request
    # handed over (that way, or off a draining worker) has the partial block its computed
    # tokens end in stored in the host KV tier: `kv_tail` is (its key there, the tokens up
    # to its end); None: none to load.
    decode_elsewhere: bool = False
    kv_tail: tuple[BlockHash, int] | None = None
    cache_salt: str | None = None  # its prefix-cache hits are the same salt's only (vLLM's)
    mm_features: list[ImageFeature] = field(default_factory=list)  # its images, by prompt position
    queued_at: float = 0.0  # this scheduler's clock
    queue_time_s: float | None = None  # until first scheduled; reported once
    scheduled_at: float = 0.0  # first scheduled, this scheduler's clock
    queue_time_reported: bool = False
    queue_time_traced: bool = False
    # The span link of trace_headers, parsed once (step tracing only; see step_tracer.py).
    trace_link: object = None
    # The tokens that may end it (EOS, stop_token_ids): any other sampled token ends it only
    # at its length limit, so landing a step tests those two things first.
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    # FINAL_ONLY (and no stop strings, which are looked for in the text as it grows): its
    # tokens are held in one output, handed over when it finishes.
    holds_output: bool = field(init=False, default=False)
    held_output: EngineCoreOutput | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        self.stop_ids = frozenset((*eos, *params.stop_token_ids))
        self.holds_output = params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def image_bytes(self) -> int:
        """The image files it carries to a worker (served requests' only: ImageFeature.source)."""
        return sum(len(f.source) for f in self.mm_features)

    def whole_images(self, start: int, num_new: int, budget: int, step_bytes: int = 0) -> int:
        """`num_new` tokens from `start`, cut so that no image's placeholders span two
        steps (Gemma 3's attend to each other both ways, and an image is encoded whole):
        a chunk ends before an image it cannot take whole, or, starting in or at one, runs
        to its end where the budget allows - else 0, to wait for a step with room. 0 too
        where its image files would take the step's (`step_bytes` so far) past STEP_IMAGE_BYTES."""
        if step_bytes and step_bytes + self.image_bytes > STEP_IMAGE_BYTES:
            return 0
        end = start + num_new
        for image in self.mm_features:
            if image.offset < end < image.end:
                if image.offset > start:
                    return image.offset - start
                return image.end - start if image.end - start <= budget else 0
        return num_new
