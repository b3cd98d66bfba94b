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

import dataclasses
import time
from collections import defaultdict

from services.scheduler.core.admission import admit
from services.scheduler.core.kv_cache_manager import KVCacheManager
from services.scheduler.core.kv_tier_index import KVTierIndex, tier_of
from services.scheduler.core.request import Request, RequestStatus
from services.scheduler.core.request_queues import RequestQueues
from services.scheduler.core.speculation import Speculation
from services.scheduler.core.state_snapshots import StateSnapshots
from services.scheduler.core.step_output import IterationTokens, pack, requests_for_worker, scheduler_stats
from services.scheduler.core.stop import check_stop
from shared.config import SchedulerConfig
from shared.lora_request import LoRARequest
from shared.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, ModelRunnerOutput,
                             SchedulerOutput, SchedulerStats, WorkerInfo)


class Scheduler(RequestQueues):
    """Each step: who runs and with how many tokens (schedule), then what the worker's
    answer does to each request (update_from_output). RequestQueues holds the requests."""

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
        config, self.snapshots = StateSnapshots.for_hybrid(config, recurrent_rows, recurrent_snapshot_rows)
        super().__init__(config, KVCacheManager(num_kv_blocks, block_size, config.enable_prefix_caching,
                                                long_rope_threshold))
        self.max_loras = max_loras
        self.vocab_size = vocab_size
        self.generates = generates
        # A request must fit in the cache on its own, or it could never finish.
        self.max_model_len = min(config.max_model_len, num_kv_blocks * block_size)
        self._step_id = 0
        self.num_generation_tokens = 0
        self.speculation = Speculation(config.num_speculative_tokens, config.speculative_disable_by_batch_size,
                                       config.speculative_probation)
        self.iteration_tokens = IterationTokens()

    @classmethod
    def for_worker(cls, config: SchedulerConfig, info: WorkerInfo, tiers: dict[str, KVTierIndex] | None = None,
                   ) -> Scheduler:
        """The core that schedules for the worker `info` announces: its blocks, vocabulary and
        state rows, the context no longer than its own, its host's KV tier (`tiers`: the
        indexes of the tiers other cores' workers map, by name)."""
        config = dataclasses.replace(config, max_model_len=min(config.max_model_len, info.max_model_len))
        core = cls(config, info.num_kv_blocks, info.block_size, info.vocab_size, info.long_rope_threshold,
                   info.generates, info.max_loras, info.recurrent_rows, info.recurrent_snapshot_rows)
        if config.enable_prefix_caching:
            core.kv_cache_manager.tier = tier_of(info.worker_id, info.kv_tier, info.kv_tier_slots, tiers,
                                                 info.kv_tier_disk_slots)
        return core

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; a `ValueError` names what is wrong with it, and nothing changes."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        request = admit(req, self.config, self.vocab_size, self.max_model_len, self.generates, self.max_loras)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def num_cached_prefix_blocks(self, token_ids: list[int], lora: LoRARequest | None = None,
                                 cache_salt: str | None = None, mm_features=()) -> int:
        """How many leading full blocks of these tokens (and images) this core's prefix cache holds."""
        return self.kv_cache_manager.num_cached_prefix_blocks(token_ids, lora, cache_salt, mm_features)

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.handing_over:  # its worker leaves: only the stores that hand its requests over
            return self.hand_over_step()
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
        # (This loop runs for every request a step: what it reads is read once, lengths directly.)
        speculating, running, max_len = self.speculation.active(len(self.running)), self.running, self.max_model_len
        allocate, quiet_until = self.kv_cache_manager.allocate_slots, self.kv_cache_manager.quiet_until
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            pending = request.num_output_placeholders
            if pending and (len(request.output_token_ids) + pending >= request.max_tokens
                            or len(request.all_token_ids) + pending >= max_len or request.awaiting_grammar) or (
                    request.decode_elsewhere and request.num_computed_tokens >= request.num_prompt_tokens):
                # The tokens in flight take it to its length limit (a further step would be
                # discarded), or its first token there may come back unsampled (a grammar's),
                # or it decodes on another worker.
                index += 1
                continue
            num_new = len(request.all_token_ids) + pending - request.num_computed_tokens
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if request.mm_features:  # (an image's placeholders go in one step)
                num_new = request.whole_images(request.num_computed_tokens, num_new, budget)
            if request.snapshot_points:
                num_new = min(num_new, max(request.snapshot_points[0] - request.num_computed_tokens, 1))
            if num_new <= 0:
                index += 1
                continue
            slots = self.speculation.draft_slots(request, num_new, budget, self.max_model_len) if speculating else 0
            num_new += slots
            while True:  # (no call where it would change nothing: KVCacheManager.quiet_until)
                quiet = request.num_computed_tokens + num_new <= quiet_until.get(request.request_id, -1)
                blocks = [] if quiet else allocate(request, num_new)
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
                self.snapshots.reserve_next(request, saves, self.kv_cache_manager.block_size)
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
        image_bytes = 0  # the files of the images of requests new to the worker this step
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
            # (the host's KV tier after the pool: not for a hybrid, whose state it does not hold)
            loads, num_loaded, source = (self.kv_cache_manager.tier_hits(request, len(computed_blocks))
                                         if self.snapshots is None else ([], 0, None))
            num_hit = len(computed_blocks) * self.kv_cache_manager.block_size + num_loaded
            if self.snapshots is not None and self.snapshots.on_its_way(request, num_hit, kv_hit,
                                                                        self.kv_cache_manager.block_size):
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
            if request.mm_features:  # (an image in one step; the step's image files within one message)
                if not (num_new := request.whole_images(num_hit, num_new, budget, image_bytes)):
                    break  # (it waits for a step with room)
                image_bytes += request.image_bytes
            snapshot_points = []
            if self.snapshots is not None:
                self.kv_cache_manager.update_block_hashes(request)  # (a prompt-logprobs request looked none up)
                snapshot_points = self.snapshots.points_for(request, num_hit, kv_hit, self.kv_cache_manager.block_size)
            if snapshot_points:
                num_new = min(num_new, snapshot_points[0] - num_hit)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks, loads, num_loaded, source)
            if blocks is None:
                break
            self.waiting.popleft()
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit, num_loaded)
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
                self.snapshots.reserve_next(request, saves, self.kv_cache_manager.block_size)
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
            # Counted as computed once the step is decided, drafts too (the rejected given back as it lands)
            request.num_computed_tokens += num_scheduled[request.request_id]
            if request.decode_elsewhere and request.num_computed_tokens == request.num_prompt_tokens:
                self.kv_cache_manager.store_tail(request, request.num_computed_tokens)  # (its prefill's last step)
            slots = num_draft_slots.get(request.request_id, 0) if num_draft_slots else 0
            if request.num_computed_tokens - slots == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1  # caught up: this step samples a token
        self.kv_cache_manager.take_tier_orders(output)
        return output

    def may_build_ahead(self) -> bool:
        """Whether the next step may be built before the one in flight lands (async
        scheduling). Not while requests speculate: it could not know how many of the
        in-flight step's drafts will be accepted, so where their next tokens begin; the
        engine waits for the landing, and the step after it carries drafts again."""
        return not (self.speculation.active(len(self.running)) and any(r.speculate and not r.awaiting_grammar for r in self.running))

    def _make_output(
        self,
        scheduled: list[Request],
        num_scheduled: dict[str, int],
        new_blocks: dict[str, list[int]],
    ) -> SchedulerOutput:
        new_reqs, cached = requests_for_worker(scheduled, new_blocks, self.kv_cache_manager.get_block_ids)
        self._step_id += 1
        finished, self._finished_for_worker = self._finished_for_worker, set()
        total = sum(num_scheduled.values())
        self.iteration_tokens.count(total)
        return SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
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
        so = scheduler_output
        if so.kv_loads or so.kv_stores or so.kv_remote_loads or self._hand_over_at:  # the KV tiers
            self.land_tier_copies(scheduler_output, runner_output)
        if runner_output.error is not None:
            for req_id in scheduler_output.num_scheduled_tokens:
                request = self.requests.get(req_id)
                if request is None:
                    continue
                self._finish(request, FinishReason.ERROR)
                outputs[request.reply_subject].append(EngineCoreOutput(
                    req_id, [], FinishReason.ERROR, error=runner_output.error, index=request.num_output_tokens,
                ))
            return pack(outputs)

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
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if request.num_discarded_tokens:  # computed before a longrope restart
                request.num_discarded_tokens -= 1
                continue
            request.awaiting_grammar = False
            if draft_slots and (slots := draft_slots.get(req_id, 0)):
                self.speculation.land(request, slots, drafted, len(sampled) - 1)
            output_ids, all_ids = request.output_token_ids, request.all_token_ids  # (append_output_token, inline)
            index = len(output_ids)
            num_generated += len(sampled)
            reason = stop_reason = None
            for token_id in sampled:
                output_ids.append(token_id)
                all_ids.append(token_id)
                # (Almost every token: not one that may stop it, nor its last; run for every
                # token of a step, so the whole test only where it can say stop.)
                if token_id in request.stop_ids or len(output_ids) >= request.max_tokens or len(all_ids) >= max_len:
                    reason, stop_reason = check_stop(request, token_id, max_len)
                    if reason is not None:
                        break
            new_tokens = sampled[:len(output_ids) - index]  # (its own list: a held output's grows)
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
                if request.decode_elsewhere:
                    self.handoffs.append(request)  # prefilled here: decoded elsewhere (Fleet.hand_off)
                if request.holds_output:
                    if request.held_output is None:
                        output.new_logprobs = list(output.new_logprobs)  # (its own: it grows)
                        request.held_output = output
                    continue
            outputs[request.reply_subject].append(output)
        self.num_generation_tokens += num_generated
        return pack(outputs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False, changing nothing, while a request holds blocks."""
        return self.kv_cache_manager.block_pool.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        return scheduler_stats(self)
