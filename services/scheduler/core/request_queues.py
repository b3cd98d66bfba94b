"""The requests a scheduler holds, and how each moves between its waiting queue and its
running list: queued (in arrival or priority order), preempted and restarted, finished,
handed over when its worker is gone and adopted by another scheduler."""

from __future__ import annotations

import bisect
from collections import deque

from services.scheduler.core.kv_cache_manager import KVCacheManager
from services.scheduler.core.request import Request, RequestStatus
from shared.config import SchedulerConfig
from shared.messages import FinishReason, ModelRunnerOutput, SchedulerOutput


class RequestQueues:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the worker still holds but must drop at the next step.
        self._finished_for_worker: set[str] = set()
        # Requests prefilled here to be decoded on another worker (disaggregation), or running
        # here while its worker leaves, once their blocks are stored: for the fleet to move
        self.handoffs: list[Request] = []
        self.handing_over = False  # its worker leaves: hand_over_step is all it schedules
        self._hand_over_at: dict[int, list[Request]] = {}  # step id -> requests it stores the last block of
        self.num_preemptions = 0

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

    def start_hand_over(self) -> list[Request]:
        """Its worker leaves, the host tier on: its waiting requests, given up now (nothing of
        theirs is computed here); its running ones are handed over by hand_over_step."""
        self.handing_over = True
        waiting = list(self.waiting)
        self.waiting.clear()
        for request in waiting:
            self.kv_cache_manager.free(request)
            if request.in_worker:
                self._finished_for_worker.add(request.request_id)
                request.in_worker = False
            del self.requests[request.request_id]
        return waiting

    def hand_over_step(self) -> SchedulerOutput:
        """While its worker leaves: a step that computes nothing, stores the last, partial block
        of each running request whose steps have all landed (its full ones are stored as they
        fill) and has the worker drop it; each is handed over when the step lands."""
        ready = [r for r in self.running if not r.num_output_placeholders and r.in_worker]
        for request in ready:
            self.kv_cache_manager.store_tail(request, request.num_computed_tokens)
            self._finished_for_worker.add(request.request_id)
            request.in_worker = False
        output = self._make_output([], {}, {})
        self.kv_cache_manager.take_tier_orders(output)
        if ready:
            self._hand_over_at[output.step_id] = ready
        return output

    def land_hand_over(self, step_id: int, failed: bool) -> None:
        ready = self._hand_over_at.pop(step_id, ())
        for request in ready:
            if failed:
                request.kv_tail = None  # (not stored: computed again where it goes)
        self.handoffs.extend(ready)

    def take_handoffs(self) -> list[Request]:
        """The requests prefilled here for another worker to decode, given up: their blocks
        freed (their prefix stays cached), their worker told to drop them."""
        taken = [r for r in self.handoffs if r.status == RequestStatus.RUNNING and r.request_id in self.requests]
        self.handoffs = []
        for request in taken:
            self.running.remove(request)
            self.kv_cache_manager.free(request)
            if request.in_worker:
                self._finished_for_worker.add(request.request_id)
                request.in_worker = False
            del self.requests[request.request_id]
            request.decode_elsewhere = False
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

    def land_tier_copies(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """A step with the host KV tier's copies landed (kv_tier_index.py): its stores of blocks
        whose writer got through are found from now on; blocks it loaded wrong are not used."""
        kv = self.kv_cache_manager
        kv.tier_orders_landed(scheduler_output.step_id, None if runner_output.error else (
            set(runner_output.req_ids) - runner_output.request_errors.keys()
            | {r.request_id for r in self._hand_over_at.get(scheduler_output.step_id, ())}))
        if self._hand_over_at:
            self.land_hand_over(scheduler_output.step_id, runner_output.error is not None)
        if runner_output.kv_bad_blocks:
            dropped = set(runner_output.kv_load_failures)
            for req_id in kv.bad_loads(scheduler_output, runner_output.kv_bad_blocks):
                self.reload(self.requests[req_id], req_id in dropped)

    def reload(self, request: Request, dropped: bool) -> None:
        """Blocks it read were loaded wrong (a checksum failed): computed again from its start,
        its blocks forgotten. `dropped`: its worker dropped it from the step that loaded them;
        else the tokens of its steps in flight (which read them) are thrown away as they land."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if dropped:
            request.in_worker = False
            request.num_output_placeholders = 0
        else:
            request.num_discarded_tokens += request.num_output_placeholders
        self.kv_cache_manager.free(request, forget_cached=True)
        self._restart(request)

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


def _priority(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time
