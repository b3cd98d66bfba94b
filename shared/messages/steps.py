"""A request as the gateway sends it, and one step between the scheduler and a worker: what
to run (SchedulerOutput) and what it gave (ModelRunnerOutput)."""

from __future__ import annotations

import enum
from collections.abc import Callable

import msgspec

from shared.lora_request import LoRARequest
from shared.messages.images import ImageFeature
from shared.messages.wire import WIRE
from shared.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the model's context
    ABORT = 2  # the client went away or asked to cancel
    ERROR = 3  # the engine could not serve it
    REJECTED = 4  # the request itself was invalid (the error says why): a client error
    OVERLOADED = 5  # the waiting queue is full: try again later
    UNAVAILABLE = 6  # the engine went away (the scheduler died or restarted)

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, **WIRE):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    reply_subject: str = ""  # which gateway gets the outputs
    trace_headers: dict[str, str] = {}
    # A resumed request: the tokens its client has already received. Kept apart from the
    # prompt, so the seed stream (seed, output position), min/max tokens and the
    # penalties carry on where they were.
    output_token_ids: list[int] = []
    # "Carry on from output_token_ids": sent again after a scheduler restart, a bus
    # reconnect or a gap in the outputs. A scheduler that still runs the request sends
    # what came after those tokens again; one that does not know it takes it as new.
    resume: bool = False
    priority: int = 0  # vLLM's; lower first, with --scheduling-policy priority only
    lora_request: LoRARequest | None = None  # the adapter that serves it; None: the base model
    # vLLM's: its prefix-cache hits only come from requests with the same salt (a tenant's
    # own), so another tenant cannot time a hit to learn what it sent.
    cache_salt: str | None = None
    # Images whose placeholder tokens the prompt holds, preprocessed (messages/images.py)
    mm_features: list[ImageFeature] = []


class NewRequestData(msgspec.Struct, **WIRE):
    """A request the worker does not hold yet: first schedule, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # already generated (non-empty when resumed)
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    mm_features: list[ImageFeature] = []


class CachedRequestData(msgspec.Struct, **WIRE):
    """Deltas for the requests the worker holds, a column a field (vLLM's shape: a step of
    128 decodes is three lists, not 128 structs to build, encode and decode): blocks added
    since the last step, and progress."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class RemoteKVLoad(msgspec.Struct, **WIRE):
    """Blocks another host's tier holds, to load over TCP before a step's forward
    (services/worker/kv_transfer.py): the server, the scheduler's one-time token for these
    slots and its expiry, and block id -> slot there."""

    address: str
    token: str
    expires: float
    orders: dict[int, int]


class SchedulerOutput(msgspec.Struct, **WIRE):
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must drop before this step: finished, aborted or preempted.
    finished_req_ids: list[str] = []
    reset: bool = False  # drop every request held before applying this step
    # Speculative decoding: request id -> how many draft tokens the worker may propose
    # and verify for it this step (their slots are counted in num_scheduled_tokens).
    num_draft_slots: dict[str, int] = {}
    # A hybrid model's prefix cache (services/scheduler/core/state_snapshots.py): request id ->
    # the snapshot slot whose recurrent state it starts from (copied to its row before this
    # step's forward), and request id -> the slot its state goes to after the forward.
    state_restores: dict[str, int] = {}
    state_saves: dict[str, int] = {}
    # The host's KV tier (--kv-offloading-size; services/scheduler/core/kv_tier_index.py):
    # block id -> the tier slot copied into it before this step's forward, and block id ->
    # the slot it is copied to after the forward.
    kv_loads: dict[int, int] = {}
    kv_stores: dict[int, int] = {}
    # With a disk tier behind it (its slots numbered after the host's): host slot -> disk
    # slot, the block a store is about to replace, copied there first.
    kv_tier_moves: dict[int, int] = {}
    kv_remote_loads: list[RemoteKVLoad] = []  # (another host's tier's blocks: loaded with kv_loads)


class Logprob(msgspec.Struct):
    """vLLM's: one token's logprob at a position, its rank there (1: the most likely) and
    its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class Logprobs(msgspec.Struct, **WIRE):
    """Logprobs of one sampled position: the sampled token first, then the top-k."""

    token_ids: list[int]  # [1 + k]
    logprobs: list[float]  # [1 + k]
    sampled_rank: int  # 1-based rank of the sampled token in the distribution

    def by_token(self, decode: Callable[[int], str | None] = lambda _: None) -> dict[int, Logprob]:
        """vLLM's shape of a position's logprobs: token id -> Logprob, the sampled token
        first (with its own rank), then the top-k in rank order (one that is both is one
        entry). `decode` gives a token's text."""
        ranks = (self.sampled_rank, *range(1, len(self.token_ids)))
        return {t: Logprob(v, rank, decode(t)) for t, v, rank in zip(self.token_ids, self.logprobs, ranks)}


class ModelRunnerOutput(msgspec.Struct, **WIRE):
    step_id: int
    req_ids: list[str]
    # Per request: [] while a prompt is still being prefilled in chunks, else [token], or
    # with speculation the accepted drafts and the token sampled after them.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[Logprobs]] = []  # per request, one per sampled token, when asked for
    error: str | None = None  # the step failed; the scheduler ends these requests
    # Requests that reached their sampling point before their grammar was compiled: no
    # token this step; the scheduler computes their last token again next step (the
    # request waits for its grammar, the batch does not).
    resample_req_ids: list[str] = []
    # Requests that failed alone (their grammar did not compile here): request id ->
    # why. The scheduler ends just these; the rest of the step stands.
    request_errors: dict[str, str] = {}
    num_draft_tokens: list[int] = []  # per request, the drafts proposed (speculation)
    # Requests that asked for prompt logprobs, in the step of their first token: one per
    # prompt token but the first (its logprob given the tokens before it, and the top-k).
    prompt_logprobs: dict[str, list[Logprobs]] = {}
    # Embedding requests (SamplingParams.embed), in the step of their token: the vector.
    pooled: dict[str, list[float]] = {}
    # The host KV tier's: blocks loaded before this step whose slot failed its checksum (not
    # used), and the new requests that read them, dropped from the step (computed again).
    kv_bad_blocks: list[int] = []
    kv_load_failures: list[str] = []
