"""One client request through the engine: n sequences, detokenized as they arrive.

`generate()` submits one engine request per choice, then yields `ChoiceDelta`s as
outputs come back. Stop strings are matched here in the text; a hit aborts that
sequence in the scheduler. Whatever ends the generator early (a disconnected client
cancels it) aborts every sequence still running, so the scheduler frees their blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from services.gateway.engine_client import BadRequest, EngineClient, Overloaded, Unavailable
from shared.detokenizer import IncrementalDetokenizer
from shared.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Choice:
    request_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0
    finished: bool = False


@dataclass(slots=True)
class Usage:
    """Token counts for the response, and the timings the metrics and the log line need."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    itls: list[float] = field(default_factory=list)
    queue_time_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    def as_dict(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


async def generate(
    client: EngineClient,
    tokenizer_backend,
    base_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_id: int | None,
    usage: Usage,
    idle_timeout_s: float = 300.0,
    trace_headers: dict[str, str] | None = None,
) -> AsyncIterator[list[ChoiceDelta]]:
    queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
    choices: dict[str, _Choice] = {}
    for index in range(params.n):
        request_id = f"{base_id}-{index}"
        choices[request_id] = _Choice(
            request_id, index,
            IncrementalDetokenizer(tokenizer_backend, prompt_token_ids, params.skip_special_tokens, params.stop),
        )
    client.open(list(choices), queue)
    usage.prompt_tokens = len(prompt_token_ids)
    try:
        now = time.time()
        for request_id, choice in choices.items():
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = msgspec.structs.replace(params, seed=params.seed + choice.index)
            await client.submit(
                EngineCoreRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=child_params,
                    eos_token_id=eos_token_id,
                    arrival_time=now,
                    reply_subject=client.reply_subject,
                    trace_headers=trace_headers or {},
                )
            )
        while not all(c.finished for c in choices.values()):
            if not queue.empty():  # no timer to arm when the output is already here
                output = queue.get_nowait()
            else:
                try:
                    output = await asyncio.wait_for(queue.get(), idle_timeout_s)
                except asyncio.TimeoutError:
                    raise Unavailable(f"the engine produced nothing for {idle_timeout_s:.0f} s") from None
            batch = [output]
            while not queue.empty():  # everything that arrived with it goes out in one write
                batch.append(queue.get_nowait())
            deltas = [d for out in batch if (d := _apply(choices, out, usage, client)) is not None]
            if deltas:
                yield _merge_by_choice(deltas)
    finally:
        client.close(list(choices))
        client.abort_soon([rid for rid, c in choices.items() if not c.finished])


def _apply(choices: dict[str, _Choice], output: EngineCoreOutput, usage: Usage, client: EngineClient) -> ChoiceDelta | None:
    choice = choices.get(output.request_id)
    if choice is None or choice.finished:
        return None
    if output.finish_reason == FinishReason.REJECTED:
        raise BadRequest(output.error or "the engine rejected the request")
    if output.finish_reason == FinishReason.OVERLOADED:
        raise Overloaded(output.error or "the engine is overloaded")
    if output.finish_reason == FinishReason.UNAVAILABLE:
        raise Unavailable(output.error or "the engine is unavailable")
    if output.error is not None and not output.new_token_ids:
        raise EngineError(output.error)
    if output.new_token_ids:
        now = time.monotonic()
        if usage.first_token_at is None:
            usage.first_token_at = now
        else:
            usage.itls.append(now - usage.last_token_at)
        usage.last_token_at = now
    if output.queue_time_s is not None and usage.queue_time_s is None:
        usage.queue_time_s = output.queue_time_s
    usage.cached_tokens = max(usage.cached_tokens, output.num_cached_tokens)
    choice.num_tokens += len(output.new_token_ids)
    usage.completion_tokens += len(output.new_token_ids)
    detok = choice.detokenizer
    stop_string = detok.update(output.new_token_ids)
    finish_reason, stop_reason = output.finish_reason, output.stop_reason
    if stop_string is not None and finish_reason is None:
        client.abort_soon([output.request_id])
        finish_reason, stop_reason = FinishReason.STOP, stop_string
    if finish_reason is not None:
        choice.finished = True
        usage.finish_reasons.append(str(finish_reason))
        detok.flush()
        if finish_reason == FinishReason.ERROR:
            raise EngineError(output.error or "the engine failed this request")
    return ChoiceDelta(
        index=choice.index,
        text=detok.get_delta(finished=choice.finished),
        token_ids=list(output.new_token_ids),
        logprobs=list(output.new_logprobs),
        finish_reason=None if finish_reason is None else str(finish_reason),
        stop_reason=detok.stop_string or stop_reason,
    )


def _merge_by_choice(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One delta per choice: a client reads one entry per index from each chunk."""
    merged: dict[int, ChoiceDelta] = {}
    for d in deltas:
        into = merged.get(d.index)
        if into is None:
            merged[d.index] = d
            continue
        into.text += d.text
        into.token_ids += d.token_ids
        into.logprobs += d.logprobs
        if d.finish_reason is not None:
            into.finish_reason, into.stop_reason = d.finish_reason, d.stop_reason
    return list(merged.values())


class EngineError(RuntimeError):
    """The engine refused or failed the request (its message says why)."""
