"""Service-to-service messages on the bus beside the steps: tokenizing, aborts, workers'
and schedulers' announcements, gateways' heartbeats and their metrics and stored responses."""

from __future__ import annotations

import msgspec

from shared.messages.images import ImageFeature
from shared.messages.outputs import SchedulerStats
from shared.messages.wire import WIRE
from shared.sampling_params import StructuredOutputsParams


class TokenizeRequest(msgspec.Struct, **WIRE):
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
    images: list[bytes] = []  # the files of the messages' image parts ({"type": "image"}), in order


class TokenizeResponse(msgspec.Struct, **WIRE):
    token_ids: list[int] = []
    error: str | None = None  # the input was bad (e.g. a template error); a 400 for the client
    mm_features: list[ImageFeature] = []  # the images, placed among token_ids


class AbortRequests(msgspec.Struct, **WIRE):
    request_ids: list[str]


class WorkerInfo(msgspec.Struct, **WIRE):
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
    # Its host's KV tier (--kv-offloading-size): the tier's name, the same for every worker
    # mapping it (host and file), and its slots of one block each; "": none.
    kv_tier: str = ""
    kv_tier_slots: int = 0
    kv_tier_disk_slots: int = 0  # (--kv-offloading-disk-path: a disk tier's, numbered after the host's)
    kv_tier_address: str = ""  # host:port where it serves its tier's slots to other hosts ("": it does not)
    tensor_parallel_size: int = 1  # its ranks (each loads from its own tier file: no transfers from other hosts)
    # Prefill/decode disaggregation (vLLM's kv_role): kv_producer, kv_consumer or kv_both
    kv_role: str = "kv_both"


class GatewayHeartbeat(msgspec.Struct, **WIRE):
    """A gateway's sign of life, twice a second: the scheduler drops the requests of one
    it has not heard for --gateway-timeout (their clients went with it); the other
    gateways know whom to ask (services/gateway/shell/peers.py)."""

    reply_subject: str  # its outputs subject, one per gateway process
    group: str = ""  # its siblings' (`llmbus serve --api-server-count`: the gateways of one port)


class MetricsQuery(msgspec.Struct, **WIRE):
    """gateway -> its siblings: your metrics, for a scrape of the port they share."""

    asker: str
    group: str


class MetricFamily(msgspec.Struct, **WIRE):
    """One Prometheus metric family as a gateway's registry collects it."""

    name: str
    documentation: str
    type: str
    samples: list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


class StoredResponse(msgspec.Struct, **WIRE):
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


class StoredResponseQuery(msgspec.Struct, **WIRE):
    """gateway -> the other gateways: the stored response of this id (response_peers.py)."""

    response_id: str
    asker: str  # the asking gateway's outputs subject (it does not answer itself)
    delete: bool = False  # and drop it


class StoredResponseAnswer(msgspec.Struct, **WIRE):
    found: bool
    stored: StoredResponse | None = None  # (a query to delete is answered without it)


class SchedulerHeartbeat(msgspec.Struct, **WIRE):
    scheduler_id: str
    num_workers: int
    # Counts the scheduler's reconnections to NATS: outputs it sent across a gap may be
    # lost, so a gateway that sees it change resumes its open requests.
    epoch: int = 0
    data_parallel_rank: int = 0  # which shard (--data-parallel-rank): gateways route among them
    # The shard's load as gateways route by it (running + waiting requests)
    num_requests: int = 0


class SchedulerInfo(msgspec.Struct, **WIRE):
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
