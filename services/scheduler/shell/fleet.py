"""Every worker the scheduler knows, each with its own scheduler core and KV block pool,
and where each request lives.

Workers are data-parallel replicas: a request is placed where its prefix is cached (or
was just sent), unless that worker is much busier than the least loaded one, and stays
there while it runs. When
a worker dies or drains, its unfinished requests move to the others and resume from
their prompt plus the tokens already generated; with no worker left they wait here,
for a bounded time. A plain object: the service shell calls it between steps.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from services.scheduler.core.request import Request
from services.scheduler.core.kv_tier_index import KVTierIndex
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.shell.wakefulness import Wakefulness
from shared.config import SchedulerConfig
from shared.kv_transfer_tokens import DEPARTED_TIER_S
from shared.prefix_affinity import PrefixAffinity, block_chain
from shared.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, SchedulerStats, WorkerInfo

log = logging.getLogger("llmbus.scheduler")

# A request ended here rather than by a worker: (its gateway's reply subject, the output).
Rejection = tuple[str, EngineCoreOutput]


@dataclass(slots=True, eq=False)
class WorkerHandle:
    info: WorkerInfo
    core: Scheduler
    last_seen: float
    # Leaving with its requests' KV: no new request; its running ones handed over (hand_off)
    # once their blocks are in the host tier, then it is removed.
    draining: bool = False

    @property
    def worker_id(self) -> str:
        return self.info.worker_id


class Fleet:
    def __init__(
        self,
        config: SchedulerConfig,
        heartbeat_timeout_s: float = 2.0,
        no_worker_timeout_s: float = 30.0,
        max_waiting_requests: int = 0,  # 0 = unbounded
        kv_events: bool = False,
        transfer_secret: bytes | None = None,
    ) -> None:
        # Each new core's pool records KV events from its first block (--kv-events-config):
        # a block cached before recording began would be missing from every consumer's view.
        self.kv_events = kv_events
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.no_worker_timeout_s = no_worker_timeout_s
        self.workers: dict[str, WorkerHandle] = {}
        self.owner: dict[str, WorkerHandle] = {}
        # Requests no worker can take yet, with when they started waiting.
        self.unplaced: deque[tuple[EngineCoreRequest | Request, float]] = deque()
        # The cumulative counts of removed workers' cores (tokens generated, prefix-cache
        # lookups, drafts, ...): the fleet's counters must never go back, or a gateway
        # would take the drop for a new scheduler and count everything again. (None: none yet.)
        self.retired_counts: SchedulerStats | None = None
        self.affinity = PrefixAffinity()  # where recent prompts' blocks were sent
        # The index of each host KV tier its workers map (--kv-offloading-size), by the tier's name
        self.kv_tiers: dict[str, KVTierIndex] = {}
        # Signs each load from another host's tier (shared/kv_transfer_tokens.py); None: none
        self.transfer_secret = transfer_secret
        # Tiers of drained workers that still serve them for a while (the worker waits
        # DRAINED_TIER_SERVE_S before it exits, shared/kv_transfer_tokens.py): the takers of
        # its requests load their KV from there. Tier name -> (address, until when, by
        # time.monotonic()).
        self._departed_tiers: dict[str, tuple[str, int, float]] = {}  # name -> (address, ranks, until)

    # ---- workers ---------------------------------------------------------------------

    def heard_from(self, info: WorkerInfo, now: float) -> list[Rejection]:
        """An announcement or heartbeat. Returns outputs for requests it had to reject."""
        handle = self.workers.get(info.worker_id)
        if info.draining:
            if handle is None or handle.draining:
                return []
            if handle.core.kv_cache_manager.tier is None or not handle.core.running:
                return self.remove(info.worker_id, "draining")
            return self._drain_keeping_kv(handle)
        if handle is not None and info.incarnation != handle.info.incarnation:
            # It reconnected to NATS: a step or its answer may have been lost in the gap, so
            # it starts afresh (its requests recompute) rather than wait out a step deadline.
            return self.remove(info.worker_id, "it reconnected to NATS") + self.heard_from(info, now)
        # A worker declared dead that speaks again rejoins as new: a fresh core, and a
        # reset of whatever it still holds with its first step.
        if handle is not None:
            handle.last_seen = now
            return []
        core = Scheduler.for_worker(self.config, info, self.kv_tiers)
        if self.transfer_secret is not None:  # (other hosts' tiers, over TCP: those of workers of as many ranks)
            core.kv_cache_manager.transfer_secret = self.transfer_secret
            core.kv_cache_manager.remote_tiers = lambda: self._served_tiers(info.kv_tier, info.tensor_parallel_size)
        if self.kv_events:
            core.kv_cache_manager.block_pool.events = []
        self.workers[info.worker_id] = WorkerHandle(info, core, now)
        log.warning("worker %s joined (%d KV blocks); %d worker(s)", info.worker_id, info.num_kv_blocks, len(self.workers))
        waiting, self.unplaced = self.unplaced, deque()
        rejected = []
        for item, since in waiting:
            rejected += self._place(item, since)
        return rejected

    def _drain_keeping_kv(self, handle: WorkerHandle) -> list[Rejection]:
        """A worker leaving with a host tier: its waiting requests go now (nothing computed);
        its running ones once its next step has stored their last blocks (hand_off), so
        the workers that take them load their KV instead of computing it again."""
        handle.draining = True
        waiting = handle.core.start_hand_over()
        log.warning("worker %s draining: handing %d running request(s) over with their KV, moving %d waiting",
                    handle.worker_id, len(handle.core.running), len(waiting))
        rejected = []
        for request in waiting:
            self.owner.pop(request.request_id, None)
            rejected += self._place(request, handle.last_seen)
        return rejected

    def remove(self, worker_id: str, reason: str) -> list[Rejection]:
        """A worker is gone (dead, timed out, drained): move its requests to the others."""
        handle = self.workers.pop(worker_id, None)
        if handle is None:
            return []
        moved = handle.core.take_unfinished()
        if handle.core.kv_cache_manager.tier is not None:
            handle.core.kv_cache_manager.drop_tier_orders()
        if self.retired_counts is None:
            self.retired_counts = SchedulerStats()
        self.retired_counts.add_counts(handle.core.make_stats())
        log.warning("worker %s removed (%s); moving %d request(s); %d worker(s) left",
                    worker_id, reason, len(moved), len(self.workers))
        rejected = []
        for request in moved:
            self.owner.pop(request.request_id, None)
            rejected += self._place(request, handle.last_seen)
        return rejected

    def saw(self, handle: WorkerHandle, now: float) -> None:
        """Proof of life other than a heartbeat: a step it answered (a handle since
        replaced proves nothing of the new one)."""
        if self.workers.get(handle.worker_id) is handle:
            handle.last_seen = max(handle.last_seen, now)

    def check(self, now: float, awake: Wakefulness | None = None) -> list[Rejection]:
        """Declare silent workers dead; fail requests that waited too long for any worker.

        A worker is silent only for as long as this process was `awake` to hear it
        (wakefulness.py): after the host descheduled the scheduler, heartbeats
        may be waiting unread in its socket."""
        rejected = []
        for handle in list(self.workers.values()):
            silent = now - handle.last_seen if awake is None else awake.silent_for(handle.last_seen, now)
            if silent > self.heartbeat_timeout_s:
                rejected += self.remove(handle.worker_id, f"no heartbeat for {now - handle.last_seen:.1f} s")
        while self.unplaced and now - self.unplaced[0][1] > self.no_worker_timeout_s:
            item, _ = self.unplaced.popleft()
            rejected.append(_error(item, f"no worker became available within {self.no_worker_timeout_s:.0f} s"))
        return rejected

    # ---- requests --------------------------------------------------------------------

    def submit(self, request: EngineCoreRequest, now: float) -> list[Rejection]:
        """Place a new request; returns a rejection when it is invalid or the queue is full.

        A request already here was sent twice (nothing to do) or is asked to resume: then
        the outputs its gateway lacks go out again. A resumed one not here (this
        scheduler is new, or it finished and its last output was lost) is placed anew."""
        known = self._known(request.request_id)
        if known is not None:
            return self._replay(known, request) if request.resume else []
        limit = self.max_waiting_requests
        if limit and not request.resume and self.num_waiting() >= limit:
            return [_error(request, f"the engine has {limit} requests waiting; try again later",
                           FinishReason.OVERLOADED)]
        return self._place(request, now)

    def _known(self, request_id: str) -> Request | EngineCoreRequest | None:
        handle = self.owner.get(request_id)
        if handle is not None:
            return handle.core.requests.get(request_id)
        return next((item for item, _ in self.unplaced if item.request_id == request_id), None)

    @staticmethod
    def _replay(known: Request | EngineCoreRequest, request: EngineCoreRequest) -> list[Rejection]:
        have = len(request.output_token_ids)
        missing = known.output_token_ids[have:]
        if not missing:
            return []
        return [(request.reply_subject, EngineCoreOutput(request.request_id, list(missing), index=have))]

    def num_requests(self) -> int:
        """Every request here, placed or waiting for a worker: the load gateways route by."""
        return len(self.owner) + len(self.unplaced)

    def num_waiting(self) -> int:
        return len(self.unplaced) + sum(len(h.core.waiting) for h in self.workers.values())

    def _place(self, item: EngineCoreRequest | Request, since: float) -> list[Rejection]:
        if not self.workers:
            self.unplaced.append((item, since))
            return []
        if isinstance(item, EngineCoreRequest):
            tokens = [*item.prompt_token_ids, *item.output_token_ids]
        else:
            tokens = item.all_token_ids
        lora = item.lora_request
        # A worker that serves adapters, for a request with one; of those, where its prefix
        # is cached or was just sent (a burst sharing a prefix lands together before any of
        # it is computed), unless that worker is much busier than the least loaded; else
        # the least loaded (shared/prefix_affinity.py).
        open_ = [h for h in self.workers.values() if not h.draining]
        if not open_:
            self.unplaced.append((item, since))
            return []
        able = [h for h in open_ if lora is None or h.info.max_loras > 0] or open_
        # Disaggregated (vLLM's kv_role): a new prompt to a prefill worker, handed to a decode
        # worker once prefilled (hand_off); one that resumes with tokens to a decode worker.
        # A role with no worker left: the other role's workers do both.
        producers = [h for h in able if h.info.kv_role == "kv_producer"]
        consumers = [h for h in able if h.info.kv_role != "kv_producer"]
        fresh = not item.output_token_ids
        disaggregate = fresh and bool(producers) and any(h.info.kv_role == "kv_consumer" for h in consumers)
        if disaggregate and self.config.max_local_prefill_length:
            # (Dynamo's conditional disaggregation: little left to compute where it would decode)
            left = min(len(tokens) - h.core.num_cached_prefix_blocks(tokens, lora, item.cache_salt, item.mm_features)
                       * h.info.block_size for h in consumers)
            disaggregate = left > self.config.max_local_prefill_length
        able = producers if disaggregate else (consumers or able)
        block_size = able[0].info.block_size
        chain = block_chain(tokens, (lora.lora_int_id if lora else None, item.cache_salt), block_size, item.mm_features)
        cached = {h: h.core.num_cached_prefix_blocks(tokens, lora, item.cache_salt, item.mm_features) for h in able}
        best = max(able, key=lambda h: (cached[h], -h.core.load()))
        if cached[best]:  # (what a pool holds outranks what was sent: the pool knows)
            self.affinity.record(chain[:cached[best]], best.worker_id)
        handle = self.affinity.choose(chain, able, key=lambda h: h.worker_id, load=lambda h: h.core.load())
        try:
            if isinstance(item, EngineCoreRequest):
                handle.core.add_request(item)
            else:
                handle.core.adopt([item])
        except ValueError as exc:
            return [_error(item, str(exc), FinishReason.REJECTED)]
        self.owner[item.request_id] = handle
        if disaggregate:
            handle.core.requests[item.request_id].decode_elsewhere = True
        return []

    def _served_tiers(self, own: str, ranks: int) -> list[tuple[KVTierIndex, str]]:
        """(index, server address) of each tier but `own` that a live worker of `ranks`
        tensor-parallel ranks serves, or a drained one still serves (a slot of a rank's file
        holds that rank's heads: only a worker sharded alike can read it)."""
        now = time.monotonic()
        self._departed_tiers = {name: entry for name, entry in self._departed_tiers.items() if entry[2] > now}
        served = {name: address for name, (address, size, _) in self._departed_tiers.items() if size == ranks}
        served.update({h.info.kv_tier: h.info.kv_tier_address for h in self.workers.values()
                       if h.info.kv_tier_address and h.info.tensor_parallel_size == ranks})
        return [(self.kv_tiers[name], address) for name, address in served.items()
                if name != own and name in self.kv_tiers]

    def hand_off(self, handle: WorkerHandle) -> tuple[list[WorkerHandle], list[Rejection]]:
        """The requests a worker hands over - prefilled on a prefill worker, or running on a
        draining one - to the least loaded decode workers (their KV from the host tier):
        the handles that took some, and rejections. A drained worker left empty goes."""
        taken, rejected = [], []
        for request in handle.core.take_handoffs():
            lora = request.lora_request
            others = [h for h in self.workers.values() if not h.draining and h is not handle
                      and (lora is None or h.info.max_loras > 0)]
            consumers = ([h for h in others if h.info.kv_role != "kv_producer"] or others
                         or ([] if handle.draining else [handle]))  # (none left: it decodes where it is)
            if not consumers:
                self.owner.pop(request.request_id, None)
                rejected += self._place(request, handle.last_seen)  # (waits for a worker)
                continue
            target = min(consumers, key=lambda h: h.core.load())
            target.core.adopt([request])
            self.owner[request.request_id] = target
            taken.append(target)
        if handle.draining and not handle.core.has_unfinished_requests():
            if handle.info.kv_tier_address:  # (its tier, served a while yet, holds what it handed over)
                self._departed_tiers[handle.info.kv_tier] = (handle.info.kv_tier_address,
                                                             handle.info.tensor_parallel_size,
                                                             time.monotonic() + DEPARTED_TIER_S)
            rejected += self.remove(handle.worker_id, "drained, its requests handed over with their KV")
        return taken, rejected

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            handle = self.owner.pop(request_id, None)
            if handle is not None:
                handle.core.abort_requests([request_id])  # its worker drops it at the next step
        if self.unplaced:
            drop = set(request_ids)
            self.unplaced = deque((item, t) for item, t in self.unplaced if item.request_id not in drop)

    def finished(self, request_id: str) -> None:
        self.owner.pop(request_id, None)

    def requests_of(self, reply_subject: str) -> list[str]:
        """The ids of the requests a gateway (its outputs subject) has here."""
        ids = [rid for rid, handle in self.owner.items()
               if getattr(handle.core.requests.get(rid), "reply_subject", None) == reply_subject]
        return ids + [item.request_id for item, _ in self.unplaced if item.reply_subject == reply_subject]

    # ---- views -----------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return min((h.core.max_model_len for h in self.workers.values()), default=0)

    @property
    def max_lora_rank(self) -> int:
        return max((h.info.max_lora_rank for h in self.workers.values()), default=0)

    def stats(self) -> SchedulerStats:
        total = SchedulerStats.combine([h.core.make_stats() for h in self.workers.values()], len(self.unplaced))
        if self.retired_counts is not None:
            total.add_counts(self.retired_counts)
        return total


def _error(item: EngineCoreRequest | Request, reason: str, finish=FinishReason.ERROR) -> Rejection:
    return item.reply_subject, EngineCoreOutput(item.request_id, [], finish, error=reason)
