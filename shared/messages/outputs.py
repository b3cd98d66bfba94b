"""What the scheduler sends a gateway: each request's new tokens, with the figures of the
core that made them."""

from __future__ import annotations

import itertools

import msgspec

from shared.messages.steps import FinishReason, Logprobs
from shared.messages.wire import WIRE


class EngineCoreOutput(msgspec.Struct, **WIRE):
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


class SchedulerStats(msgspec.Struct, **WIRE):
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
    # The host KV tier's (--kv-offloading-size), vLLM's names: cumulative prompt tokens looked
    # up where a tier is, and found in the tier (beside the pool's, which prefix_cache_* count)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0

    @classmethod
    def combine(cls, parts: list["SchedulerStats"], num_waiting_elsewhere: int = 0) -> "SchedulerStats":
        """Several cores as one: counts add up, KV usage is the mean of their fractions."""
        if len(parts) == 1:  # (a shard of one worker, every step: its figures as they are)
            return msgspec.structs.replace(parts[0], num_waiting_reqs=parts[0].num_waiting_reqs + num_waiting_elsewhere)
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


class EngineCoreOutputs(msgspec.Struct, **WIRE):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # The scheduler dropped this gateway's requests while it was silent (--gateway-timeout)
    # and now hears it again: it sends every open request again, resumed.
    resume_all: bool = False
