"""A request entering a scheduler: every check that can refuse it (a `ValueError` naming
what is wrong, nothing changed), then its scheduling state."""

from __future__ import annotations

import time

import msgspec

from services.scheduler.core.request import Request
from shared.config import SchedulerConfig
from shared.messages import EngineCoreRequest
from shared.sampling_params import SamplingParams


def admit(req: EngineCoreRequest, config: SchedulerConfig, vocab_size: int, max_model_len: int, generates: bool,
          max_loras: int) -> Request:
    """The request's scheduling state, or a ValueError saying why it cannot run here."""
    num_prompt = len(req.prompt_token_ids)
    num_output = len(req.output_token_ids)
    if num_prompt == 0:
        raise ValueError("prompt must contain at least one token")
    if req.priority and config.scheduling_policy != "priority":
        raise ValueError("priority is only taken with --scheduling-policy priority")
    if num_prompt >= max_model_len:
        raise ValueError(
            f"prompt is {num_prompt} tokens, but the model's context is "
            f"{max_model_len} tokens and at least one must be left to generate"
        )
    bad = [t for t in (*req.prompt_token_ids, *req.output_token_ids) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    params = req.sampling_params
    if not (generates or params.embed):
        raise ValueError("this model has no LM head: it serves embeddings (/v1/embeddings, LLM.embed) or, "
                         "a classifier, classes (/classify, LLM.classify), not generation")
    if params.bad_words and params.bad_words_token_ids is None:
        raise ValueError("bad_words reached the scheduler untokenized (shared.sampling_params."
                         "with_bad_words_tokenized sets their token ids)")
    bad_word_ids = [t for word in params.bad_words_token_ids or () for t in word]
    for field, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ()),
                       ("bad_words", bad_word_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{field} token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    params = _logprobs_resolved(params, config.max_logprobs, vocab_size)
    if req.lora_request is not None and not max_loras:
        raise ValueError(req.lora_request.not_served())
    _check_images(req, config)
    room = max_model_len - num_prompt
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    if num_output >= max_tokens:
        raise ValueError(f"a resumed request has {num_output} of its {max_tokens} tokens already: nothing to do")
    return Request(
        request_id=req.request_id,
        prompt_token_ids=list(req.prompt_token_ids),
        sampling_params=params,
        eos_token_id=req.eos_token_id,
        max_tokens=max_tokens,
        arrival_time=req.arrival_time or time.time(),
        reply_subject=req.reply_subject,
        priority=req.priority,
        trace_headers=dict(req.trace_headers),
        queued_at=time.monotonic(),
        all_token_ids=[*req.prompt_token_ids, *req.output_token_ids],
        output_token_ids=list(req.output_token_ids),
        lora_request=req.lora_request,
        cache_salt=req.cache_salt,
        mm_features=sorted(req.mm_features, key=lambda f: f.offset),
    )


def _check_images(req: EngineCoreRequest, config: SchedulerConfig) -> None:
    """Each image's placeholders inside the prompt, apart from the others', and no more of
    them than one step computes: an image goes in one step (Request.whole_images), so a
    larger one could never be scheduled (a 400 here, never a hang: vLLM's #26223)."""
    end = 0
    for image in sorted(req.mm_features, key=lambda f: f.offset):
        if image.offset < end or image.length <= 0 or image.end > len(req.prompt_token_ids):
            raise ValueError(f"image placeholders at [{image.offset}, {image.end}) are outside the prompt or overlap "
                             "another image's")
        if image.length > config.max_num_batched_tokens:
            raise ValueError(f"an image of {image.length} tokens is more than a step computes "
                             f"(max_num_batched_tokens={config.max_num_batched_tokens}): raise it or send a smaller "
                             "image")
        end = image.end


def _logprobs_resolved(params: SamplingParams, max_logprobs: int, vocab_size: int) -> SamplingParams:
    """`params` with -1 logprobs as the vocabulary's size; a ValueError past --max-logprobs
    (vLLM's check and message)."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    resolved = {}
    for field in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, field)
        if asked == -1:
            asked = resolved[field] = vocab_size
        if asked is not None and asked > cap:
            raise ValueError(f"Requested {'sample' if field == 'logprobs' else 'prompt'} logprobs of {asked}, "
                             f"which is greater than max allowed: {cap} (--max-logprobs)")
    return msgspec.structs.replace(params, **resolved) if resolved else params
