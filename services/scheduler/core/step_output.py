"""What a step's decisions become on the wire: full data for the requests new to the
worker and only deltas for the ones it holds (SchedulerOutput), the outputs of a landed
step grouped by gateway with the scheduler's figures (EngineCoreOutputs), and the step
sizes counted for /metrics."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.core.request import Request
from shared.messages import (
    ITERATION_TOKENS_BUCKETS,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    NewRequestData,
    SchedulerStats,
)


def requests_for_worker(scheduled: list[Request], new_blocks: dict[str, list[int]],
                        block_ids: Callable[[str], list[list[int]]]) -> tuple[list[NewRequestData], CachedRequestData]:
    """The scheduled requests as the worker takes them: a request it does not hold yet in
    full (and from now on held), the others as their new blocks and computed count."""
    new_reqs, cached_ids, cached_blocks, cached_computed = [], [], [], []
    for request in scheduled:
        if request.in_worker:
            cached_ids.append(request.request_id)
            cached_blocks.append(new_blocks[request.request_id])
            cached_computed.append(request.num_computed_tokens)
            continue
        request.in_worker = True
        request.awaiting_grammar = request.sampling_params.structured_outputs is not None
        new_reqs.append(NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            block_ids=block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        ))
    return new_reqs, CachedRequestData(cached_ids, cached_blocks, cached_computed)


@dataclass(slots=True)
class IterationTokens:
    """Steps by their tokens (vLLM's iteration_tokens_total): a count per bucket, and the tokens."""

    by_bucket: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    total: int = 0

    def count(self, num_tokens: int) -> None:
        if num_tokens:
            self.by_bucket[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self.total += num_tokens


def pack(outputs: dict[str, list[EngineCoreOutput]]) -> dict[str, EngineCoreOutputs]:
    """Each gateway's outputs. The figures that go with them are the shell's to add (a
    fleet's, once a step: services/scheduler/shell/service.py)."""
    now = time.time()
    return {subject: EngineCoreOutputs(outs, timestamp=now) for subject, outs in outputs.items()}


def adapter_names(requests) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def scheduler_stats(scheduler) -> SchedulerStats:
    """A scheduler core's figures now (Scheduler.make_stats)."""
    kv, speculation = scheduler.kv_cache_manager, scheduler.speculation
    return SchedulerStats(
        num_running_reqs=len(scheduler.running),
        num_waiting_reqs=len(scheduler.waiting),
        kv_cache_usage=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        external_prefix_cache_queries=kv.external_prefix_cache_queries,
        external_prefix_cache_hits=kv.external_prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_generation_tokens=scheduler.num_generation_tokens,
        spec_decode_num_drafts=speculation.num_drafts,
        spec_decode_num_draft_tokens=speculation.num_draft_tokens,
        spec_decode_num_accepted_tokens=speculation.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(speculation.accepted_per_pos),
        max_lora=scheduler.max_loras,
        running_lora_adapters=adapter_names(scheduler.running),
        waiting_lora_adapters=adapter_names(scheduler.waiting),
        iteration_tokens_by_bucket=list(scheduler.iteration_tokens.by_bucket),
        iteration_tokens_sum=scheduler.iteration_tokens.total,
    )
