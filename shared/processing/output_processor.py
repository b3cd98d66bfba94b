"""Engine outputs into what a client reads, one client request at a time.

A client request with `n` choices is `n` engine requests (`<id>-<index>`, each seeded
`seed + index`, or all n would be one sample). Each choice's tokens are detokenized
incrementally (or, for a reader that wants it only at the end, in one decode then); stop
strings are matched in the text, and a hit finishes the choice here while the engine still
runs it, so the caller must abort it there. The offline `LLM`
collects the deltas into `RequestOutput`s; the gateway frames them as JSON or SSE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from shared.processing.detokenizer import IncrementalDetokenizer
from shared.lora_request import LoRARequest
from shared.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine output adds to one choice."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    needs_abort: bool = False  # a stop string ended it here; the engine still runs it
    prompt_logprobs: list[Logprobs] = field(default_factory=list)  # with the first delta, when asked for
    pooled: list[float] | None = None  # an embedding request's vector
    prefill_time_s: float | None = None  # with the first token (EngineCoreOutput's)


@dataclass(slots=True)
class _Choice:
    index: int
    detokenizer: IncrementalDetokenizer
    finished: bool = False


class ParentRequest:
    """One client request: its engine requests, and the state of each of its choices."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,  # a `tokenizers.Tokenizer`
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        reply_subject: str = "",
        trace_headers: dict[str, str] | None = None,
        first_index: int = 0,  # of its first choice in the response (a batch of prompts)
        incremental: bool = True,  # False: each choice's text comes whole, with its finish
        priority: int = 0,  # the scheduler's, under its priority policy
        lora_request: LoRARequest | None = None,  # the adapter that serves it (None: the base model)
        cache_salt: str | None = None,  # its prefix-cache hits are the same salt's only
        mm_features: list | None = None,  # its images (ImageFeature), preprocessed
    ) -> None:
        self.request_id = request_id
        self.engine_requests: list[EngineCoreRequest] = []
        self._choices: dict[str, _Choice] = {}
        for index in range(params.n):
            child_id = f"{request_id}-{index}"
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = msgspec.structs.replace(params, seed=params.seed + index)
            self.engine_requests.append(EngineCoreRequest(
                request_id=child_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=child_params,
                eos_token_id=eos_token_id,
                arrival_time=arrival_time,
                reply_subject=reply_subject,
                trace_headers=trace_headers or {},
                priority=priority,
                lora_request=lora_request,
                cache_salt=cache_salt,
                mm_features=mm_features or [],
            ))
            self._choices[child_id] = _Choice(
                first_index + index, IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                                    incremental, params.include_stop_str_in_output),
            )
        self._unfinished = len(self._choices)  # (asked after every output: counted, not scanned)

    @property
    def child_ids(self) -> list[str]:
        return list(self._choices)

    @property
    def finished(self) -> bool:
        return self._unfinished == 0

    def unfinished_ids(self) -> list[str]:
        return [rid for rid, c in self._choices.items() if not c.finished]

    def apply(self, output: EngineCoreOutput) -> ChoiceDelta | None:
        """The delta of one output; None when its choice is unknown or already over (a
        token that was in flight when a stop string ended it)."""
        choice = self._choices.get(output.request_id)
        if choice is None or choice.finished:
            return None
        detok = choice.detokenizer
        stop_string = detok.update(output.new_token_ids)
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        needs_abort = stop_string is not None and finish_reason is None
        if needs_abort:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        if finish_reason is not None:
            choice.finished = True
            self._unfinished -= 1
            detok.flush()
        # Positional, and the output's lists themselves (each output is read once, here):
        # this runs for every token of every request, and keywords cost it 3x.
        return ChoiceDelta(
            output.request_id, choice.index, detok.get_delta(choice.finished), output.new_token_ids,
            output.new_logprobs, finish_reason, detok.stop_string or stop_reason, output.error,
            output.num_cached_tokens, output.queue_time_s, needs_abort, output.prompt_logprobs, output.pooled,
            output.prefill_time_s,
        )
