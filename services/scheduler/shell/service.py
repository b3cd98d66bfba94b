"""The scheduler service: the fleet of per-worker scheduler cores behind the bus.

Requests, aborts and worker heartbeats arrive between steps (one event loop: no core is
touched concurrently with itself). Each worker gets an engine core of its own
(`engine_core.py`: the step pipeline, two steps in flight by default) whose executor is
a NATS request to that worker, so workers never wait for each other; every landed step's
`EngineCoreOutputs` go to each request's gateway. A monitor declares dead a worker that
misses its step deadline or its heartbeats, cancels its engine core, and its requests
move to the others; it drops the requests of a gateway gone silent (gateways.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec

from services.scheduler.engine_core import EngineCore, LandedStep, WorkerLost
from services.scheduler.shell.fleet import Fleet, Rejection, WorkerHandle
from services.scheduler.shell.gateways import Gateways
from services.scheduler.shell.kv_event_publisher import KVEventPublisher
from services.scheduler.shell.nats_executor import NatsExecutor
from services.scheduler.step_tracer import StepTracer
from services.scheduler.shell.wakefulness import Wakefulness
from shared.kv_transfer_tokens import secret_from_env
from shared.bus import BusAuth, Subjects, close_for_exit, connect, encode, stop_on_signals
from shared.config import SchedulerConfig
from shared.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    GatewayHeartbeat,
    SchedulerHeartbeat,
    SchedulerInfo,
    WorkerInfo,
)
from shared.tracing import setup_tracing, shutdown_tracing, tracing_enabled

log = logging.getLogger("llmbus.scheduler")

STATS_INTERVAL_S = 0.05  # the stats subject's most frequent publish (_stats_changed)


class SchedulerService:
    def __init__(
        self,
        nc,
        subjects: Subjects,
        config: SchedulerConfig,
        step_timeout_s: float = 120.0,
        heartbeat_timeout_s: float = 2.0,
        no_worker_timeout_s: float = 30.0,
        max_waiting_requests: int = 0,
        async_scheduling: bool = True,
        gateway_timeout_s: float = 10.0,
        data_parallel_rank: int = 0,
        kv_events: bool = False,
    ) -> None:
        """`kv_events`: publish KV cache events (--kv-events-config, kv_event_publisher.py)."""
        self.nc = nc
        # This shard's (--data-parallel-rank): its own requests and aborts subjects, and
        # the workers that name it; gateways route among shards by their heartbeats.
        self.rank = data_parallel_rank
        self.async_scheduling = async_scheduling
        self.subjects = subjects
        self.step_timeout_s = step_timeout_s
        self.fleet = Fleet(config, heartbeat_timeout_s, no_worker_timeout_s,
                           max_waiting_requests, kv_events, transfer_secret=secret_from_env())
        self.gateways = Gateways(gateway_timeout_s)
        self.kv_events = (KVEventPublisher(nc, subjects, data_parallel_rank, self.fleet.workers)
                          if kv_events else None)
        self.scheduler_id = uuid.uuid4().hex[:8]
        tracer = setup_tracing("scheduler")
        self.step_tracer = StepTracer(tracer if tracing_enabled() else None)
        self.wake = asyncio.Event()
        self.engines: dict[str, EngineCore] = {}  # worker id -> the engine core driving it
        self._stats_sent: tuple | None = None  # (running, waiting, kv usage) last published
        self._stats_sent_at = 0.0
        self._stats_timer: asyncio.TimerHandle | None = None  # a changed figure's publish, due
        self._stats_task: asyncio.Future | None = None  # (held: the loop keeps only weak references)
        self.epoch = 0  # reconnections to NATS, in every heartbeat
        self._request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(AbortRequests)
        self._worker_decoder = msgspec.msgpack.Decoder(WorkerInfo)
        self._gateway_decoder = msgspec.msgpack.Decoder(GatewayHeartbeat)

    async def start(self) -> None:
        s = self.subjects
        await self.nc.subscribe(s.requests(self.rank), cb=self.on_request)
        await self.nc.subscribe(s.abort(self.rank), cb=self.on_abort)
        await self.nc.subscribe(s.announce, cb=self.on_announce)
        await self.nc.subscribe(s.scheduler_info, cb=self.on_info)
        await self.nc.subscribe(s.gateway_heartbeat, cb=self.on_gateway_heartbeat)
        if self.kv_events is not None:
            await self.kv_events.start()
        await self.nc.flush()
        await self.nc.publish(s.scheduler_hello, b"")  # workers already up announce themselves

    # ---- inbound --------------------------------------------------------------------

    async def on_request(self, msg) -> None:
        try:
            request = self._request_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("dropped a malformed request: %s", exc)
            return
        await self._publish_rejections(self.fleet.submit(request, time.monotonic()))
        self._wake_all()
        await self._stats_changed()

    async def on_abort(self, msg) -> None:
        try:
            ids = self._abort_decoder.decode(msg.data).request_ids
        except msgspec.DecodeError:
            return
        self.fleet.abort(ids)
        self._wake_all()  # so the worker hears of it at the next step
        await self._stats_changed()

    async def on_announce(self, msg) -> None:
        try:
            info = self._worker_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if info.data_parallel_rank != self.rank:  # another shard's; one of ours that moved there leaves
            if info.worker_id in self.fleet.workers:
                await self._publish_rejections(self.fleet.remove(info.worker_id, "it joined another shard"))
                self._wake_all()
            return
        await self._publish_rejections(self.fleet.heard_from(info, time.monotonic()))
        self._wake_all()

    async def on_gateway_heartbeat(self, msg) -> None:
        try:
            subject = self._gateway_decoder.decode(msg.data).reply_subject
        except msgspec.DecodeError:
            return
        if self.gateways.heard(subject, time.monotonic()):
            log.warning("gateway %s speaks again: it resumes its requests", subject)
            await self.nc.publish(subject, encode(EngineCoreOutputs([], resume_all=True)))

    async def on_info(self, msg) -> None:
        fleet = self.fleet
        info = SchedulerInfo(
            scheduler_id=self.scheduler_id,
            model=self.subjects.model,
            num_workers=len(fleet.workers),
            max_model_len=fleet.max_model_len,
            stats=fleet.stats() if fleet.workers else None,
            max_lora_rank=fleet.max_lora_rank,
            data_parallel_rank=self.rank,
        )
        await msg.respond(encode(info))

    async def on_reconnect(self) -> None:
        """Steps in flight across a NATS reconnect may be lost (a step or its answer), and
        a worker may have applied a step whose answer never came: every worker starts
        afresh. Its requests wait, rejoin with it at its next heartbeat and recompute."""
        for worker_id in list(self.fleet.workers):
            await self._publish_rejections(self.fleet.remove(worker_id, "NATS reconnected"))
        # Outputs sent across the gap may be lost: the next heartbeat has every gateway
        # resume its open requests (each gets what it lacks again).
        self.epoch += 1
        self._wake_all()

    async def _publish_rejections(self, rejections: list[Rejection]) -> None:
        for subject, output in rejections:
            if subject:
                await self.nc.publish(subject, encode(EngineCoreOutputs([output])))

    def _wake_all(self) -> None:
        """The monitor and every engine core: something may have changed for any of them."""
        self.wake.set()
        for engine in self.engines.values():
            engine.wake()

    # ---- the engine cores -----------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """The monitor: one engine core per live worker, dead ones cancelled, waiters expired."""
        tasks: dict[str, tuple[WorkerHandle, asyncio.Task]] = {}
        last_heartbeat = 0.0
        awake = Wakefulness()  # ticked by this loop, every 0.25 s while the host runs us
        try:
            while not stop.is_set():
                now = time.monotonic()
                awake.tick(now)
                if now - last_heartbeat >= 0.5:  # gateways watch this to notice a dead scheduler
                    last_heartbeat = now
                    beat = SchedulerHeartbeat(self.scheduler_id, len(self.fleet.workers), self.epoch, self.rank,
                                              self.fleet.num_requests())
                    await self.nc.publish(self.subjects.scheduler_heartbeat, encode(beat))
                    await self._publish_stats()  # idle included: gauges come back to 0
                    if self.kv_events is not None:  # (a worker's departure, evictions between steps)
                        await self.kv_events.flush()
                await self._publish_rejections(self.fleet.check(now, awake))
                self._drop_silent_gateways(now, awake)
                for worker_id, (handle, task) in list(tasks.items()):
                    if self.fleet.workers.get(worker_id) is not handle:
                        task.cancel()  # removed (dead, drained) or rejoined as a new handle
                        del tasks[worker_id]
                        self.engines.pop(worker_id, None)
                for worker_id, handle in self.fleet.workers.items():
                    if worker_id not in tasks:
                        tasks[worker_id] = (handle, asyncio.create_task(self._drive(handle)))
                await self._sleep(stop, timeout=0.25)
        finally:
            for _, task in tasks.values():
                task.cancel()
            if self._stats_timer is not None:
                self._stats_timer.cancel()

    def _drop_silent_gateways(self, now: float, awake: Wakefulness) -> None:
        for subject in self.gateways.silent(now, awake):
            ids = self.fleet.requests_of(subject)
            log.warning("gateway %s silent for %.0f s: dropping its %d request(s)", subject,
                        self.gateways.timeout_s, len(ids))
            if ids:
                self.fleet.abort(ids)
                self._wake_all()

    async def _drive(self, handle: WorkerHandle) -> None:
        executor = NatsExecutor(self.nc, self.subjects.step(handle.worker_id), handle.worker_id, self.step_timeout_s)
        engine = EngineCore(
            handle.core, executor, 2 if self.async_scheduling else 1, self.step_tracer, handle.worker_id,
            needs_reset=True,  # a new core: the worker may still hold state from before
        )
        self.engines[handle.worker_id] = engine
        try:
            await engine.run(lambda landed: self._publish(handle, landed))
        except WorkerLost as exc:  # its requests move on to the other workers
            if self.fleet.workers.get(handle.worker_id) is handle:
                await self._publish_rejections(self.fleet.remove(handle.worker_id, str(exc)))
            self._wake_all()

    def _fleet_stats(self, **step):
        return msgspec.structs.replace(self.fleet.stats(), scheduler_id=self.scheduler_id,
                                       data_parallel_rank=self.rank, **step)

    async def _publish_stats(self, only_if_changed: bool = False) -> None:
        """The fleet's stats on their own subject: every gateway renders the latest, so
        /metrics is right between requests too, not only when an output passes by."""
        stats = self._fleet_stats()
        key = (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)
        if only_if_changed and key == self._stats_sent:
            return
        self._stats_sent, self._stats_sent_at = key, time.monotonic()
        await self.nc.publish(self.subjects.scheduler_stats, encode(stats))

    async def _stats_changed(self) -> None:
        """Something the stats count changed (a step landed, a request came or went): they
        go out at most every STATS_INTERVAL_S, the last change always (a timer). A gateway
        with requests here has them with every step's outputs already; the others route by
        these (shard_router.py counts what it sent since) — a publish, and every gateway's
        decoding of it, a step would cost more than that lag is worth (vLLM's DP
        coordinator publishes its engines' counts every 100 ms)."""
        if self._stats_timer is not None:
            return  # (one is due: it will read the figures then)
        wait = self._stats_sent_at + STATS_INTERVAL_S - time.monotonic()
        if wait <= 0:
            await self._publish_stats(only_if_changed=True)
        else:
            self._stats_timer = asyncio.get_running_loop().call_later(wait, self._stats_due)

    def _stats_due(self) -> None:
        self._stats_timer = None
        self._stats_task = asyncio.ensure_future(self._publish_stats(only_if_changed=True))

    async def _publish(self, handle: WorkerHandle, landed: LandedStep) -> None:
        self.fleet.saw(handle, time.monotonic())  # a step it answered: alive
        if landed.outputs:  # (the fleet's figures, with each step's worker and time: the gateways' metrics)
            step_stats = self._fleet_stats(worker_id=handle.worker_id, step_time_s=landed.step_time_s)
        for subject, outputs in landed.outputs.items():
            outputs.scheduler_stats = step_stats
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.fleet.finished(output.request_id)
            if subject:
                await self.nc.publish(subject, encode(outputs))
        await self._stats_changed()
        if handle.core.handoffs:  # prefilled here, decoded elsewhere (disaggregation), or drained
            targets, rejected = self.fleet.hand_off(handle)
            for target in targets:
                engine = self.engines.get(target.worker_id)
                if engine is not None:
                    engine.wake()
            await self._publish_rejections(rejected)
        if self.kv_events is not None:
            await self.kv_events.flush()

    async def _sleep(self, stop: asyncio.Event, timeout: float) -> None:
        self.wake.clear()
        waiter = asyncio.ensure_future(self.wake.wait())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        stopper.cancel()


async def serve(
    nats_url: str,
    model_name: str,
    config: SchedulerConfig,
    ready: asyncio.Event | None = None,
    auth: BusAuth | None = None,
    **options,
) -> None:
    """`options` are SchedulerService's keyword arguments (timeouts, limits, caching)."""
    holder: list[SchedulerService] = []

    async def on_reconnect() -> None:
        if holder:
            await holder[0].on_reconnect()

    nc = await connect(nats_url, "scheduler", on_reconnect, auth)
    service = SchedulerService(nc, Subjects(model_name), config, **options)
    holder.append(service)
    await service.start()
    stop = stop_on_signals()
    log.info("scheduler %s (shard %d) ready", service.scheduler_id, service.rank)
    if ready is not None:
        ready.set()
    await service.run(stop)
    await close_for_exit(nc)
    shutdown_tracing()
