"""The scheduler core: who runs this step, and with how many tokens.

No prefill or decode phase: every request has `num_computed_tokens` chasing
`num_tokens`, and each step spends one token budget on closing those gaps, running
requests first, then waiting ones. A long prompt is spread over steps (chunked prefill);
when blocks run out the newest running request is preempted by recompute. Under the
"priority" policy (vLLM's) the waiting queue is kept in (priority, arrival) order and the
running request last in that order is the one preempted.
It knows nothing of tensors or transport: it takes and returns `shared.messages`.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import defaultdict, deque

import msgspec

from services.scheduler.core.kv_cache_manager import KVCacheManager
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.state_snapshots import StateSnapshots
from shared.config import SchedulerConfig
from shared.lora_request import LoRARequest
from shared.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ITERATION_TOKENS_BUCKETS,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)

log = logging.getLogger(__name__)

# A speculating request whose drafts are accepted less than this often, once it has had
# this many, stops speculating: a rejected draft costs a row of the forward for nothing.
SPEC_PROBATION_TOKENS = 32
SPEC_MIN_ACCEPTANCE = 0.2


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        block_size: int,
        vocab_size: int,
        long_rope_threshold: int | None = None,
        generates: bool = True,  # False: the model has no LM head and only embeds
        max_loras: int = 0,  # LoRA adapters its worker can run at once (0: none)
        recurrent_rows: int = 0,  # a hybrid model's: the requests its worker's recurrent state holds (0: none)
        recurrent_snapshot_rows: int = 0,  # and the snapshots of that state it keeps for the prefix cache
    ) -> None:
        self.snapshots: StateSnapshots | None = None
        if recurrent_rows:
            # A recurrent layer's state is a request's whole past folded into one row: a
            # cached prefix restores it only from a snapshot of the state at the prefix's
            # end (state_snapshots.py); without snapshots every request computes from its
            # first token. No more run at once than the worker has rows for.
            caching = config.enable_prefix_caching and recurrent_snapshot_rows > 0
            if config.enable_prefix_caching != caching or config.max_num_seqs > recurrent_rows:
                log.info("a hybrid model: prefix caching %s, max_num_seqs %d", "on" if caching else "off",
                         min(config.max_num_seqs, recurrent_rows))
            config = dataclasses.replace(config, enable_prefix_caching=caching,
                                         max_num_seqs=min(config.max_num_seqs, recurrent_rows))
            if caching:
                self.snapshots = StateSnapshots(recurrent_snapshot_rows)
        self.config = config
        self.max_loras = max_loras
        self.vocab_size = vocab_size
        self.generates = generates
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, block_size, config.enable_prefix_caching,
                                               long_rope_threshold)
        # A request must fit in the cache on its own, or it could never finish.
        self.max_model_len = min(config.max_model_len, num_kv_blocks * block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the worker still holds but must drop at the next step.
        self._finished_for_worker: set[str] = set()
        self._step_id = 0
        self.num_preemptions = 0
        self.num_generation_tokens = 0
        # Speculative decoding, cumulative (vLLM's spec_decode_* counters).
        k = config.num_speculative_tokens
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * k
        # Steps by their tokens (vLLM's iteration_tokens_total), per bucket, and the tokens.
        self.iteration_tokens_by_bucket = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; a `ValueError` names what is wrong with it, and nothing changes."""
        num_prompt = len(req.prompt_token_ids)
        num_output = len(req.output_token_ids)
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if num_prompt == 0:
            raise ValueError("prompt must contain at least one token")
        if req.priority and self.config.scheduling_policy != "priority":
            raise ValueError("priority is only taken with --scheduling-policy priority")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt is {num_prompt} tokens, but the model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        bad = [t for t in (*req.prompt_token_ids, *req.output_token_ids) if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        params = req.sampling_params
        if not (self.generates or params.embed):
            raise ValueError("this model has no LM head: it serves embeddings (/v1/embeddings, LLM.embed) or, "
                             "a classifier, classes (/classify, LLM.classify), not generation")
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words reached the scheduler untokenized (shared.sampling_params."
                             "with_bad_words_tokenized sets their token ids)")
        bad_word_ids = [t for word in params.bad_words_token_ids or () for t in word]
        for field, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("bad_words", bad_word_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{field} token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        params = self._logprobs_resolved(params)
        if req.lora_request is not None and not self.max_loras:
            raise ValueError(req.lora_request.not_served())
        room = self.max_model_len - num_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if num_output >= max_tokens:
            raise ValueError(f"a resumed request has {num_output} of its {max_tokens} tokens already: nothing to do")
        request = Request(
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
        )
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _logprobs_resolved(self, params: SamplingParams) -> SamplingParams:
        """`params` with -1 logprobs as the vocabulary's size; a ValueError past --max-logprobs
        (vLLM's check and message)."""
        cap = self.vocab_size if self.config.max_logprobs == -1 else self.config.max_logprobs
        resolved = {}
        for field in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, field)
            if asked == -1:
                asked = resolved[field] = self.vocab_size
            if asked is not None and asked > cap:
                raise ValueError(f"Requested {'sample' if field == 'logprobs' else 'prompt'} logprobs of {asked}, "
                                 f"which is greater than max allowed: {cap} (--max-logprobs)")
        return msgspec.structs.replace(params, **resolved) if resolved else params

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at its back (new) or front (preempted, adopted) under
        FCFS; under "priority" in (priority, arrival) order, ahead of its equals when
        `front`."""
        if self.config.scheduling_policy == "fcfs":
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            return
        place = bisect.bisect_left if front else bisect.bisect_right
        self.waiting.insert(place(self.waiting, _priority(request), key=_priority), request)

    def _victim(self, first: int) -> Request:
        """The running request to preempt, among those from `first` on (the ones this
        step has not scheduled yet): the newest, or the last in priority order."""
        if self.config.scheduling_policy == "fcfs":
            return self.running.pop()
        victim = max(self.running[first:], key=_priority)
        self.running.remove(victim)
        return victim

    def take_unfinished(self) -> list[Request]:
        """Hand every unfinished request over (its worker is gone), oldest first.

        Their blocks lived on that worker, so nothing is freed here: this core is dropped.
        """
        taken = sorted(list(self.running) + list(self.waiting), key=lambda r: r.queued_at)
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        return taken

    def adopt(self, requests: list[Request]) -> None:
        """Take requests from another worker: they resume from their prompt plus the tokens
        already generated, recomputed here, ahead of requests that arrived later."""
        for request in reversed(requests):
            if request.request_id in self.requests:
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0  # the steps in flight died with the worker
            request.in_worker = False
            self.requests[request.request_id] = request
            self._enqueue(request, front=True)

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def num_cached_prefix_blocks(self, token_ids: list[int], lora: LoRARequest | None = None,
                                 cache_salt: str | None = None) -> int:
        """How many leading full blocks of these tokens this core's prefix cache holds."""
        return self.kv_cache_manager.num_cached_prefix_blocks(token_ids, lora, cache_salt)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_work(self) -> bool:
        """Something to schedule, or finished requests the worker has yet to drop."""
        return self.has_unfinished_requests() or bool(self._finished_for_worker)

    def _finish(self, request: Request, reason: FinishReason, stop_reason=None) -> None:
        """End a request for good; an ERROR also forgets the prefix blocks it registered."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_cache_manager.free(request, forget_cached=reason == FinishReason.ERROR)
        if request.in_worker:
            self._finished_for_worker.add(request.request_id)
            request.in_worker = False
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        """Recompute later: give back all blocks and start over from the front of the queue."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._restart(request)

    def _restart(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if request.in_worker:
            self._finished_for_worker.add(request.request_id)
            request.in_worker = False
        self._enqueue(request, front=True)

    def _restart_long(self, request: Request) -> None:
        """longrope: transformers recomputes a sequence with the long factors, from its first
        token, once it grows past the threshold (Phi-3's generate drops its cache there), so
        the request starts over, hashed anew (long blocks are other blocks), and the token a
        step in flight computes for it in the old mode is dropped when it lands."""
        self.running.remove(request)
        request.block_hashes.clear()
        request.num_discarded_tokens = request.num_output_placeholders
        self._restart(request)

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        num_scheduled: dict[str, int] = {}
        num_draft_slots: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled: list[Request] = []
        preempted_now = False
        restores: dict[str, int] = {}  # a hybrid's prefix hits: request id -> its snapshot slot
        saves: dict[str, int] = {}  # and its states saved after this step: request id -> slot

        # Running requests first, oldest first; the newest is the first to be preempted.
        # With steps in flight (async scheduling), a request is scheduled as if the tokens
        # it will sample there were known: the worker has them by the time it runs this step.
        speculating = self._speculating()  # (once a step: this loop runs for every request)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._will_finish(request) or (request.awaiting_grammar and request.num_output_placeholders):
                # Its last token is in flight (a further step would be discarded), or its
                # first token there may come back unsampled.
                index += 1
                continue
            num_new = len(request.all_token_ids) + request.num_output_placeholders - request.num_computed_tokens
            if threshold:
                num_new = min(num_new, threshold)
            num_new = min(num_new, budget)
            if request.snapshot_points:
                num_new = min(num_new, max(request.snapshot_points[0] - request.num_computed_tokens, 1))
            if num_new <= 0:
                index += 1
                continue
            slots = self._draft_slots(request, num_new, budget) if speculating else 0
            num_new += slots
            while True:
                blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self._victim(index)
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
            if blocks is None:
                # It gave its own blocks back: last in preemption order, though (priority
                # policy) not always last in the list; the requests after it may still run.
                continue
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            if request.snapshot_points and request.num_computed_tokens + num_new == request.snapshot_points[0]:
                self._save_snapshot(request, saves)
            if slots:
                num_draft_slots[request.request_id] = slots
            new_blocks[request.request_id] = [b.block_id for b in blocks] if blocks else []  # (a decode's: mostly none)
            budget -= num_new
            index += 1

        # Then waiting ones, unless this step had to preempt: there is no room to spare.
        # No more than max_loras adapters run at once (the worker's slots): a request of
        # another adapter waits, in its place, while those behind it may go (vLLM's rule).
        loras = {r.lora_request for r in self.running if r.lora_request is not None} if self.max_loras else set()
        skipped: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and not preempted_now
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            lora = request.lora_request
            if lora is not None and lora not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if request.num_output_placeholders:
                # Preempted with a step in flight: its token must land before it can be
                # sent to the worker again as prompt + output.
                break
            computed_blocks = self.kv_cache_manager.get_computed_blocks(request)
            restore, kv_hit = None, len(computed_blocks) * self.kv_cache_manager.block_size
            if self.snapshots is not None:  # a hybrid's hit ends where a snapshot of its state does
                num_blocks, restore = self.snapshots.longest_hit(request.block_hashes, len(computed_blocks))
                computed_blocks = computed_blocks[:num_blocks]
            num_hit = len(computed_blocks) * self.kv_cache_manager.block_size
            if self.snapshots is not None and self._state_on_its_way(request, num_hit, kv_hit):
                # A step in flight saves the state after more of its cached blocks (a
                # system prompt another request just reached): it waits a step or two for
                # that, in its place, rather than compute those blocks again.
                skipped.append(self.waiting.popleft())
                continue
            num_new = request.num_tokens - num_hit
            if threshold:
                num_new = min(num_new, threshold)
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            snapshot_points = self._snapshot_points(request, num_hit, kv_hit)
            if snapshot_points:
                num_new = min(num_new, snapshot_points[0] - num_hit)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks)
            if blocks is None:
                break
            self.waiting.popleft()
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.queue_time_s is None:
                request.scheduled_at = time.monotonic()
                request.queue_time_s = request.scheduled_at - request.queued_at
            request.num_computed_tokens = num_hit
            request.snapshot_points = snapshot_points
            if restore is not None:
                restores[request.request_id] = restore
            if snapshot_points and num_hit + num_new == snapshot_points[0]:
                # (reserved now: a request after it in this loop waits for that save)
                self._save_snapshot(request, saves)
            request.status = RequestStatus.RUNNING
            request.long_rope = self.kv_cache_manager.runs_long(request)
            if lora is not None:
                loras.add(lora)
            self.running.append(request)
            scheduled.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))  # (ahead of the rest, in their order)

        output = self._make_output(scheduled, num_scheduled, new_blocks)
        output.num_draft_slots = num_draft_slots
        output.state_restores, output.state_saves = restores, saves
        for request in scheduled:
            # Counted as computed now, when the step is decided, not when it lands (draft
            # slots too: what is rejected is given back when it lands).
            request.num_computed_tokens += num_scheduled[request.request_id]
            slots = num_draft_slots.get(request.request_id, 0) if num_draft_slots else 0
            if request.num_computed_tokens - slots == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1  # caught up: this step samples a token
        return output

    def _snapshot_points(self, request: Request, num_hit: int, kv_hit: int) -> list[int]:
        """Where a hybrid request (re)starting after `num_hit` tokens saves its recurrent
        state, ascending: the last block boundary before its last token (as far as the same
        tokens again can hit: one is always computed), for the same prompt again or a
        conversation's next turn; and where its KV cache hit ends (`kv_hit`) if no state
        was saved there: blocks another request computed before, a prefix they share (a
        system prompt), so the requests after both find a state at its end. Boundaries
        saved already, or not past the hit, are left out."""
        if self.snapshots is None:
            return []
        bs = self.kv_cache_manager.block_size
        self.kv_cache_manager.update_block_hashes(request)  # (a prompt-logprobs request looked none up)
        points = sorted({kv_hit, (request.num_tokens - 1) // bs * bs})
        return [p for p in points if p > num_hit and not self.snapshots.has(request.block_hashes[p // bs - 1])]

    def _state_on_its_way(self, request: Request, num_hit: int, kv_hit: int) -> bool:
        """Whether a save in flight would let this hybrid request start past `num_hit`:
        at a block boundary of its KV cache hit (`kv_hit`) beyond it."""
        bs = self.kv_cache_manager.block_size
        return any(self.snapshots.saving(request.block_hashes[end // bs - 1]) for end in range(kv_hit, num_hit, -bs))

    def _save_snapshot(self, request: Request, saves: dict[str, int]) -> None:
        """This step computes the request's tokens up to its next snapshot point: the
        worker saves its state there after the forward (findable once the step lands)."""
        block_hash = request.block_hashes[request.snapshot_points.pop(0) // self.kv_cache_manager.block_size - 1]
        slot = self.snapshots.reserve(block_hash)
        if slot is not None:  # (None: every slot has a save in flight; this one goes unsaved)
            saves[request.request_id] = slot

    def _speculating(self) -> bool:
        limit = self.config.speculative_disable_by_batch_size
        return bool(self.config.num_speculative_tokens) and (limit is None or len(self.running) <= limit)

    def may_build_ahead(self) -> bool:
        """Whether the next step may be built before the one in flight lands (async
        scheduling). Not while requests speculate: it could not know how many of the
        in-flight step's drafts will be accepted, so where their next tokens begin; the
        engine waits for the landing, and the step after it carries drafts again."""
        return not (self._speculating() and any(r.speculate and not r.awaiting_grammar for r in self.running))

    def _draft_slots(self, request: Request, num_new: int, budget: int) -> int:
        """Draft tokens the worker may verify for a decoding request this step, the batch
        speculating (`_speculating`): never past max_tokens or the context, none while its
        worker may still be compiling its grammar (its token may come back unsampled), none
        once its drafts stopped paying."""
        k = self.config.num_speculative_tokens
        if num_new != 1 or request.num_output_placeholders or not request.speculate or request.awaiting_grammar:
            return 0
        return max(0, min(k, request.max_tokens - request.num_output_tokens - 1,
                          self.max_model_len - request.num_tokens - 1, budget - 1))

    def _will_finish(self, request: Request) -> bool:
        """Whether the tokens in flight already take the request to its length limit."""
        pending = request.num_output_placeholders
        return pending > 0 and (  # (lengths read directly: this runs for every request a step)
            len(request.output_token_ids) + pending >= request.max_tokens
            or len(request.all_token_ids) + pending >= self.max_model_len
        )

    def _make_output(
        self,
        scheduled: list[Request],
        num_scheduled: dict[str, int],
        new_blocks: dict[str, list[int]],
    ) -> SchedulerOutput:
        new_reqs, cached_ids, cached_blocks, cached_computed = [], [], [], []
        for request in scheduled:
            if request.in_worker:
                cached_ids.append(request.request_id)
                cached_blocks.append(new_blocks[request.request_id])
                cached_computed.append(request.num_computed_tokens)
            else:
                request.in_worker = True
                request.awaiting_grammar = request.sampling_params.structured_outputs is not None
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        eos_token_id=request.eos_token_id,
                        block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                        num_computed_tokens=request.num_computed_tokens,
                        lora_request=request.lora_request,
                    )
                )
        self._step_id += 1
        finished, self._finished_for_worker = self._finished_for_worker, set()
        total = sum(num_scheduled.values())
        if total:
            self.iteration_tokens_by_bucket[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, total)] += 1
            self.iteration_tokens_sum += total
        return SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(cached_ids, cached_blocks, cached_computed),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=sorted(finished),
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[str, EngineCoreOutputs]:
        """Apply sampled tokens, finish what should finish; outputs grouped by reply subject."""
        outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
        if scheduler_output.state_saves:  # a hybrid's snapshots: made where the worker computed the request
            computed = set(runner_output.req_ids) if runner_output.error is None else set()
            for req_id, slot in scheduler_output.state_saves.items():
                self.snapshots.landed(slot, req_id in computed and req_id not in runner_output.request_errors)
        if runner_output.error is not None:
            for req_id in scheduler_output.num_scheduled_tokens:
                request = self.requests.get(req_id)
                if request is None:
                    continue
                self._finish(request, FinishReason.ERROR)
                outputs[request.reply_subject].append(EngineCoreOutput(
                    req_id, [], FinishReason.ERROR, error=runner_output.error, index=request.num_output_tokens,
                ))
            return self._pack(outputs)

        for req_id, why in runner_output.request_errors.items():
            request = self.requests.get(req_id)
            if request is not None:
                request.in_worker = False  # the worker has dropped it
                self._finish(request, FinishReason.ERROR)
                outputs[request.reply_subject].append(EngineCoreOutput(
                    req_id, [], FinishReason.ERROR, error=why, index=request.num_output_tokens))
        for req_id in runner_output.resample_req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            if request.status == RequestStatus.RUNNING:  # (not preempted meanwhile)
                request.num_computed_tokens -= 1  # its last token again, to sample from
        logprobs = runner_output.logprobs or [[]] * len(runner_output.req_ids)
        num_drafts = runner_output.num_draft_tokens or [0] * len(runner_output.req_ids)
        long_rope = self.kv_cache_manager.long_rope_threshold is not None  # (Phi-3's longrope: mostly not)
        max_len = self.max_model_len
        draft_slots = scheduler_output.num_draft_slots
        num_generated = 0
        for req_id, sampled, lps, drafted in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, logprobs, num_drafts
        ):
            request = self.requests.get(req_id)
            if request is None or not sampled:
                continue  # finished meanwhile (aborted, or ended by an earlier step's token), or a prompt chunk
            request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            if request.num_discarded_tokens:  # computed before a longrope restart
                request.num_discarded_tokens -= 1
                continue
            request.awaiting_grammar = False
            if draft_slots and (slots := draft_slots.get(req_id, 0)):
                self._land_drafts(request, slots, drafted, len(sampled) - 1)
            index = len(request.output_token_ids)
            new_tokens = []
            num_generated += len(sampled)
            reason = stop_reason = None
            for token_id in sampled:
                request.append_output_token(token_id)
                new_tokens.append(token_id)
                # (Almost every token: not one that may stop it, nor its last; run for every
                # token of a step, so the whole test only where it can say stop.)
                if (token_id in request.stop_ids or len(request.output_token_ids) >= request.max_tokens
                        or len(request.all_token_ids) >= max_len):
                    reason, stop_reason = self._check_stop(request, token_id)
                    if reason is not None:
                        break
            new_logprobs = lps[:len(new_tokens)] if lps else lps
            output = request.held_output
            if output is not None:  # FINAL_ONLY: this step's tokens join the ones held
                output.new_token_ids += new_tokens
                if new_logprobs:
                    output.new_logprobs += new_logprobs
            else:
                output = EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_tokens,
                    new_logprobs=new_logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    index=index,
                    prompt_logprobs=runner_output.prompt_logprobs.get(req_id, []) if index == 0 else [],
                    pooled=runner_output.pooled.get(req_id) if index == 0 else None,
                )
                if not request.queue_time_reported:  # its first token
                    output.queue_time_s = request.queue_time_s
                    output.prefill_time_s = time.monotonic() - request.scheduled_at
                    request.queue_time_reported = True
            if reason is not None:
                self._finish(request, reason, stop_reason)
                output.finish_reason = reason
                output.stop_reason = stop_reason
                output.num_cached_tokens = max(request.num_cached_tokens, 0)  # (a held output's, now)
            else:
                if (long_rope and not request.long_rope and request.status == RequestStatus.RUNNING
                        and self.kv_cache_manager.runs_long(request)):
                    self._restart_long(request)  # it just grew past the threshold
                if request.holds_output:
                    if request.held_output is None:
                        output.new_logprobs = list(output.new_logprobs)  # (its own: it grows)
                        request.held_output = output
                    continue
            outputs[request.reply_subject].append(output)
        self.num_generation_tokens += num_generated  # (before _pack: its figures count them)
        return self._pack(outputs)

    def _land_drafts(self, request: Request, slots: int, num_drafted: int, num_accepted: int) -> None:
        """The slots not filled by accepted drafts were counted as computed: give them back
        (their K/V is overwritten later; blocks are hashed from known tokens only, so no
        draft enters the prefix cache). Count, and stop speculating for a request whose
        drafts keep being rejected."""
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= slots - num_accepted
        if not num_drafted:
            return
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafted
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1
        request.num_draft_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        if request.num_draft_tokens >= SPEC_PROBATION_TOKENS and (
                request.num_accepted_tokens < SPEC_MIN_ACCEPTANCE * request.num_draft_tokens):
            request.speculate = False

    def _pack(self, outputs: dict[str, list[EngineCoreOutput]]) -> dict[str, EngineCoreOutputs]:
        if not outputs:
            return {}  # (a step of held outputs only: no one to send figures to)
        stats = self.make_stats()
        now = time.time()
        return {
            subject: EngineCoreOutputs(outs, scheduler_stats=stats, timestamp=now)
            for subject, outs in outputs.items()
        }

    def _check_stop(self, request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
        """Whether `token_id`, just appended, ends the request (update_from_output asks only
        for one in `request.stop_ids` or at a length limit: keep the two in step)."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            # A grammar allows the stop token only where it is complete: it ends a
            # constrained request even with ignore_eos.
            if (
                (not params.ignore_eos or params.structured_outputs is not None)
                and request.eos_token_id is not None
                and token_id == request.eos_token_id
            ):
                return FinishReason.STOP, None
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        if request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH, None
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False, changing nothing, while a request holds blocks."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_generation_tokens=self.num_generation_tokens,
            spec_decode_num_drafts=self.spec_num_drafts,
            spec_decode_num_draft_tokens=self.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_accepted_per_pos),
            max_lora=self.max_loras,
            running_lora_adapters=_adapter_names(self.running),
            waiting_lora_adapters=_adapter_names(self.waiting),
            iteration_tokens_by_bucket=list(self.iteration_tokens_by_bucket),
            iteration_tokens_sum=self.iteration_tokens_sum,
        )


def _adapter_names(requests) -> list[str]:
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def _priority(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
