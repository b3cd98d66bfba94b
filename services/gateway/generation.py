"""One client request through the engine: its n engine requests submitted, their
outputs turned into `ChoiceDelta`s by the shared output processor as they arrive.

A stop string found in the text ends its choice here and aborts it in the scheduler.
Whatever ends the generator early (a disconnected client cancels it) aborts every
choice still running, so the scheduler frees their blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from services.gateway.engine import Engine
from services.gateway.errors import Unavailable, raise_for_engine_error
from services.gateway.output_queue import OutputQueue
from shared.lora_request import LoRARequest
from shared.processing.output_processor import ChoiceDelta, ParentRequest
from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class ChoiceTimes:
    """One choice's (one engine request's) course at this gateway: vLLM's per-request
    histograms observe each engine request, so n choices are n observations."""

    prompt_tokens: int
    num_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    itls: list[float] = field(default_factory=list)
    queue_time_s: float | None = None  # the scheduler's: queued -> first scheduled
    prefill_time_s: float | None = None  # the scheduler's: first scheduled -> first token
    finish_reason: str | None = None
    finished_at: float | None = None
    token_ids: list[int] | None = None  # its tokens, kept for the request log (--enable-log-outputs)

    @property
    def decode_time_s(self) -> float:
        """First token -> last token (vLLM's decode interval)."""
        return 0.0 if self.first_token_at is None else self.last_token_at - self.first_token_at


@dataclass(slots=True)
class Usage:
    """Token counts for the response, and the timings the metrics and the log line need."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    queue_time_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    on_tokens: Callable[[int], None] | None = None  # told of tokens as they go out (metrics)
    # Choice index -> its course (`generate` opens one per choice: prompt p's i-th is p * n + i).
    choices: dict[int, ChoiceTimes] = field(default_factory=dict)
    n: int = 1
    max_tokens: int | None = None
    keep_token_ids: bool = False  # each choice keeps its tokens (ChoiceTimes.token_ids)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    def begin(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self.prompt_tokens = sum(len(token_ids) for token_ids in prompts)
        self.n, self.max_tokens = params.n, params.max_tokens
        self.choices = {p * params.n + i: ChoiceTimes(len(token_ids), token_ids=[] if self.keep_token_ids else None)
                        for p, token_ids in enumerate(prompts) for i in range(params.n)}

    def count(self, delta: ChoiceDelta) -> None:
        choice = self.choices[delta.index]  # (`begin` opened every choice)
        now = time.monotonic() if delta.token_ids or delta.finish_reason is not None else 0.0
        if delta.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            if choice.first_token_at is None:
                choice.first_token_at = now
            else:
                choice.itls.append(now - choice.last_token_at)
            choice.last_token_at = now
            choice.num_tokens += len(delta.token_ids)
            if choice.token_ids is not None:
                choice.token_ids += delta.token_ids
        if delta.queue_time_s is not None and self.queue_time_s is None:
            self.queue_time_s = delta.queue_time_s
        if delta.queue_time_s is not None and choice.queue_time_s is None:
            choice.queue_time_s = delta.queue_time_s
        if delta.prefill_time_s is not None and choice.prefill_time_s is None:
            choice.prefill_time_s = delta.prefill_time_s
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        self.completion_tokens += len(delta.token_ids)
        if delta.token_ids and self.on_tokens is not None:
            self.on_tokens(len(delta.token_ids))
        if delta.finish_reason is not None:
            self.finish_reasons.append(str(delta.finish_reason))
            choice.finish_reason, choice.finished_at = str(delta.finish_reason), now


async def generate(
    client: Engine,
    tokenizer_backend,
    base_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_token_id: int | None,
    usage: Usage,
    idle_timeout_s: float = 300.0,
    trace_headers: dict[str, str] | None = None,
    incremental: bool = True,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
    cache_salt: str | None = None,
) -> AsyncIterator[list[ChoiceDelta]]:
    """One ParentRequest per prompt (a completions batch has several), their choices
    numbered prompt by prompt. Not `incremental` (a response sent whole): each choice's
    text comes with its last delta."""
    queue = OutputQueue()
    now = time.time()
    parents = [
        ParentRequest(
            base_id if len(prompts) == 1 else f"{base_id}-{p}", token_ids, params, tokenizer_backend, eos_token_id,
            now, client.reply_subject, trace_headers, first_index=p * params.n, incremental=incremental,
            priority=priority, lora_request=lora_request, cache_salt=cache_salt,
            mm_features=getattr(token_ids, "mm_features", None),  # (a chat's images: PromptWithImages)
        )
        for p, token_ids in enumerate(prompts)
    ]
    of_child = {rid: parent for parent in parents for rid in parent.child_ids}
    client.open(list(of_child), queue)
    usage.begin(prompts, params)
    # The idle timeout: one timer a request, which re-arms itself from the last output when
    # it fires (a timer a token, wait_for's or asyncio.timeout's, costs every streamed token
    # a heap push and pop among every other stream's timers).
    loop = asyncio.get_running_loop()
    last_output_at = loop.time()

    def check_idle() -> None:
        nonlocal watchdog
        if not queue.empty():  # (outputs wait for a slow client: the engine is not idle)
            watchdog = loop.call_later(idle_timeout_s, check_idle)
        elif loop.time() - last_output_at >= idle_timeout_s:
            queue.put_nowait(_IDLE)  # (into an empty queue: the first thing the reader takes)
        else:
            watchdog = loop.call_at(last_output_at + idle_timeout_s, check_idle)

    watchdog = loop.call_at(last_output_at + idle_timeout_s, check_idle)
    try:
        for parent in parents:
            for request in parent.engine_requests:
                await client.submit(request)
        only = parents[0] if len(parents) == 1 else None
        while not (only.finished if only is not None else all(parent.finished for parent in parents)):
            output = queue.get_nowait() if not queue.empty() else await queue.get()
            if output is _IDLE:
                raise Unavailable(f"the engine produced nothing for {idle_timeout_s:.0f} s")
            last_output_at = loop.time()
            batch = [output]
            while not queue.empty():  # everything that arrived with it goes out in one write
                batch.append(queue.get_nowait())
            deltas = []
            for out in batch:
                parent = of_child.get(out.request_id)
                delta = parent.apply(out) if parent is not None else None
                if delta is None:
                    continue
                raise_for_engine_error(delta)
                if delta.needs_abort:
                    client.abort_soon([delta.request_id])
                usage.count(delta)
                deltas.append(delta)
            if deltas:
                yield _merge_by_choice(deltas)
    finally:
        watchdog.cancel()
        # (the aborts first: each goes to the shard the ledger says, which closing forgets)
        client.abort_soon([rid for parent in parents for rid in parent.unfinished_ids()])
        client.close(list(of_child))


_IDLE = object()  # (put in a request's queue by its idle timer)


def _merge_by_choice(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One delta per choice: a client reads one entry per index from each chunk."""
    merged: dict[int, ChoiceDelta] = {}
    for d in deltas:
        into = merged.get(d.index)
        if into is None:
            merged[d.index] = d
            continue
        # New lists: a delta's are its engine output's own (output_processor.py).
        into.text += d.text
        into.token_ids = into.token_ids + d.token_ids
        into.logprobs = into.logprobs + d.logprobs
        into.prompt_logprobs = into.prompt_logprobs + d.prompt_logprobs
        if d.finish_reason is not None:
            into.finish_reason, into.stop_reason = d.finish_reason, d.stop_reason
    return list(merged.values())
