"""Wire messages between gateway, scheduler and workers.

msgspec structs, msgpack on the bus; `array_like` keeps them compact (fields go by
position, not name) and `gc=False` because they hold no cycles. This module imports
nothing heavy so every service (and the gateway's hot path) can load it cheaply.

Naming follows vLLM V1: the scheduler sends full data for requests a worker has not
seen (`NewRequestData`) and only deltas for the ones it holds (`CachedRequestData`).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable

import msgspec

from shared.lora_request import LoRARequest
from shared.sampling_params import SamplingParams, StructuredOutputsParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


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


class EngineCoreRequest(msgspec.Struct, **_WIRE):
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


class NewRequestData(msgspec.Struct, **_WIRE):
    """A request the worker does not hold yet: first schedule, or resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # already generated (non-empty when resumed)
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None


class CachedRequestData(msgspec.Struct, **_WIRE):
    """Deltas for the requests the worker holds, a column a field (vLLM's shape: a step of
    128 decodes is three lists, not 128 structs to build, encode and decode): blocks added
    since the last step, and progress."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, **_WIRE):
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


class Logprob(msgspec.Struct):
    """vLLM's: one token's logprob at a position, its rank there (1: the most likely) and
    its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class Logprobs(msgspec.Struct, **_WIRE):
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


class ModelRunnerOutput(msgspec.Struct, **_WIRE):
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


class EngineCoreOutput(msgspec.Struct, **_WIRE):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it
    new_logprobs: list[Logprobs] = []
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    # Seconds between the scheduler queueing it and first scheduling it; on the first
    # output only (for the request_queue_time metric).
    queue_time_s: float | None = None
    # The output position of new_token_ids[0]: a gateway drops what it already has and
    # notices a gap (outputs lost on the bus), for which it asks to resume.
    index: int = 0
    prompt_logprobs: list[Logprobs] = []  # on the first output, when asked for (ModelRunnerOutput's)
    pooled: list[float] | None = None  # an embedding request's vector, on its first output
    # Seconds between first scheduling it and landing its first token, on that output
    # (vLLM's request_prefill_time, in the scheduler's clock as vLLM's in its engine core's).
    prefill_time_s: float | None = None


class SchedulerStats(msgspec.Struct, **_WIRE):
    """One scheduler core's figures, or a fleet's (`combine`); rendered as they are by
    /health and, under vLLM's names, by /metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found
    num_preemptions: int = 0  # cumulative
    num_generation_tokens: int = 0  # cumulative tokens sampled
    scheduler_id: str = ""
    worker_id: str = ""  # the worker of the step these outputs came from
    step_time_s: float = 0.0  # that step's duration as the scheduler saw it
    # Speculative decoding, cumulative: steps with drafts, drafts, accepted drafts, and
    # accepted drafts by position (vLLM's spec_decode_* counters).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # LoRA (vLLM's lora_requests_info): adapter slots (a fleet's add up) and the adapters
    # of the running and of the waiting requests, by name.
    max_lora: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Tokens a step, cumulative (vLLM's iteration_tokens_total histogram): steps by bucket
    # of ITERATION_TOKENS_BUCKETS (one more at the end: beyond them) and their tokens.
    iteration_tokens_by_bucket: list[int] = []
    iteration_tokens_sum: int = 0
    data_parallel_rank: int = 0  # the scheduler shard's (--data-parallel-rank)

    @classmethod
    def combine(cls, parts: list["SchedulerStats"], num_waiting_elsewhere: int = 0) -> "SchedulerStats":
        """Several cores as one: counts add up, KV usage is the mean of their fractions."""
        total = cls(num_waiting_reqs=num_waiting_elsewhere)
        for name in _SUMMED_STATS:
            setattr(total, name, getattr(total, name) + sum(getattr(p, name) for p in parts))
        if parts:
            total.kv_cache_usage = sum(p.kv_cache_usage for p in parts) / len(parts)
        total.spec_decode_num_accepted_tokens_per_pos = _sum_by_position(
            p.spec_decode_num_accepted_tokens_per_pos for p in parts)
        total.iteration_tokens_by_bucket = _sum_by_position(p.iteration_tokens_by_bucket for p in parts)
        total.running_lora_adapters = sorted({n for p in parts for n in p.running_lora_adapters})
        total.waiting_lora_adapters = sorted({n for p in parts for n in p.waiting_lora_adapters})
        return total

    def add_counts(self, other: "SchedulerStats") -> None:
        """Add `other`'s cumulative counts to these (its gauges are left out): a fleet keeps
        the counts of the workers it lost, so that its counters never go back."""
        for name in CUMULATIVE_STATS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.spec_decode_num_accepted_tokens_per_pos = _sum_by_position(
            [self.spec_decode_num_accepted_tokens_per_pos, other.spec_decode_num_accepted_tokens_per_pos])
        self.iteration_tokens_by_bucket = _sum_by_position(
            [self.iteration_tokens_by_bucket, other.iteration_tokens_by_bucket])


# vLLM's buckets of iteration_tokens_total (the tokens of one engine step).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _sum_by_position(lists) -> list[int]:
    return [sum(c) for c in itertools.zip_longest(*lists, fillvalue=0)]


# Every count of SchedulerStats (the int fields): what `combine` adds up.
_SUMMED_STATS = [
    f.name for f in msgspec.structs.fields(SchedulerStats) if f.type is int
]
# The counts that only grow (the rest are gauges: what runs and waits now, adapter slots).
CUMULATIVE_STATS = [name for name in _SUMMED_STATS if name not in ("num_running_reqs", "num_waiting_reqs", "max_lora")]


class EngineCoreOutputs(msgspec.Struct, **_WIRE):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # The scheduler dropped this gateway's requests while it was silent (--gateway-timeout)
    # and now hears it again: it sends every open request again, resumed.
    resume_all: bool = False


# ---- service-to-service messages on the bus ---------------------------------------------


class TokenizeRequest(msgspec.Struct, **_WIRE):
    """At most one of `prompt` and `messages` is set; with neither, only the
    structured-output spec is checked."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # compiled as a check
    tools: list[dict] | None = None  # OpenAI's tools, rendered into the chat prompt
    continue_final_message: bool = False  # the last (assistant) message left open, to go on from
    chat_template_kwargs: dict | None = None  # more variables for the template (Qwen3's enable_thinking)
    documents: list[dict] | None = None  # vLLM's: documents for a RAG template (Granite's, Command R's)


class TokenizeResponse(msgspec.Struct, **_WIRE):
    token_ids: list[int] = []
    error: str | None = None  # the input was bad (e.g. a template error); a 400 for the client


class AbortRequests(msgspec.Struct, **_WIRE):
    request_ids: list[str]


class WorkerInfo(msgspec.Struct, **_WIRE):
    """A worker's announcement (and heartbeat): who it is and what its cache holds."""

    worker_id: str
    model: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None = None
    draining: bool = False  # leaving: take no new requests, move the running ones away
    # Random at the worker's start, +1 at each reconnection to NATS: a step or its answer
    # may have been lost in the gap, or died with the process before (a restart keeps the
    # id), so the scheduler takes a changed one back as a new worker (a reset, recompute).
    incarnation: int = 0
    # The model's longrope threshold (Phi-3), which decides how its prompts' blocks hash.
    long_rope_threshold: int | None = None
    generates: bool = True  # False: a model without an LM head, which only embeds
    # LoRA adapters it can run in one step (--max-loras with --enable-lora); 0: none.
    max_loras: int = 0
    max_lora_rank: int = 0  # the largest adapter rank it takes (--max-lora-rank); 0: none
    # A hybrid model's (Qwen3.5's): the requests its linear layers' state holds at once;
    # 0: a model without such state. And the snapshots of that state it keeps for the
    # prefix cache (0: prefix caching off, every request computed from its first token).
    recurrent_rows: int = 0
    recurrent_snapshot_rows: int = 0
    data_parallel_rank: int = 0  # the scheduler shard it joins (--data-parallel-rank)


class GatewayHeartbeat(msgspec.Struct, **_WIRE):
    """A gateway's sign of life, twice a second: the scheduler drops the requests of one
    it has not heard for --gateway-timeout (their clients went with it); the other
    gateways know whom to ask (services/gateway/shell/peers.py)."""

    reply_subject: str  # its outputs subject, one per gateway process
    group: str = ""  # its siblings' (`llmbus serve --api-server-count`: the gateways of one port)


class MetricsQuery(msgspec.Struct, **_WIRE):
    """gateway -> its siblings: your metrics, for a scrape of the port they share."""

    asker: str
    group: str


class MetricFamily(msgspec.Struct, **_WIRE):
    """One Prometheus metric family as a gateway's registry collects it."""

    name: str
    documentation: str
    type: str
    samples: list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


class StoredResponse(msgspec.Struct, **_WIRE):
    """A Responses API response a gateway stored (services/gateway/responses_api/store.py),
    as kept and as another gateway of the deployment is sent it."""

    response: bytes  # the response's JSON, as it was sent and as GET returns it
    # JSON: the chat messages a response that goes on from this one starts with (the
    # conversation before it, its input and its output; instructions, which OpenAI does
    # not carry over, left out)
    conversation: bytes

    @property
    def size(self) -> int:
        return len(self.response) + len(self.conversation)


class StoredResponseQuery(msgspec.Struct, **_WIRE):
    """gateway -> the other gateways: the stored response of this id (response_peers.py)."""

    response_id: str
    asker: str  # the asking gateway's outputs subject (it does not answer itself)
    delete: bool = False  # and drop it


class StoredResponseAnswer(msgspec.Struct, **_WIRE):
    found: bool
    stored: StoredResponse | None = None  # (a query to delete is answered without it)


class SchedulerHeartbeat(msgspec.Struct, **_WIRE):
    scheduler_id: str
    num_workers: int
    # Counts the scheduler's reconnections to NATS: outputs it sent across a gap may be
    # lost, so a gateway that sees it change resumes its open requests.
    epoch: int = 0
    data_parallel_rank: int = 0  # which shard (--data-parallel-rank): gateways route among them
    # The shard's load as gateways route by it (running + waiting requests)
    num_requests: int = 0


class SchedulerInfo(msgspec.Struct, **_WIRE):
    """The scheduler's answer to a health/info query."""

    scheduler_id: str
    model: str
    num_workers: int
    max_model_len: int
    stats: SchedulerStats | None = None
    # The largest LoRA rank a worker of the fleet takes (0: none serves adapters), so a
    # gateway refuses a runtime adapter load no worker could run with a 400, at the load.
    max_lora_rank: int = 0
    data_parallel_rank: int = 0
    # Filled in by a gateway that asked every shard (--data-parallel-size): rank -> workers
    shard_workers: dict[int, int] = {}

    @classmethod
    def combine(cls, shards: list["SchedulerInfo"]) -> "SchedulerInfo":
        """Every shard's answer as one deployment's: workers and requests add up, the
        context is the shortest any worker serves."""
        if len(shards) == 1:
            return msgspec.structs.replace(shards[0], shard_workers={shards[0].data_parallel_rank: shards[0].num_workers})
        serving = [s for s in shards if s.num_workers] or shards
        stats = [s.stats for s in shards if s.stats is not None]
        return cls(
            scheduler_id=",".join(s.scheduler_id for s in shards), model=shards[0].model,
            num_workers=sum(s.num_workers for s in shards), max_model_len=min(s.max_model_len for s in serving),
            stats=SchedulerStats.combine(stats) if stats else None, max_lora_rank=max(s.max_lora_rank for s in shards),
            shard_workers={s.data_parallel_rank: s.num_workers for s in shards})
