"""The scheduler service: the tick loop around the fleet of per-worker scheduler cores.

Requests, aborts and worker heartbeats arrive between ticks (one event loop: no core is
touched concurrently with itself). Each worker has its own tick loop
(workers never wait for each other): `schedule()` -> its `SchedulerOutput` as a NATS
request -> the `ModelRunnerOutput` -> `update_from_output()` -> `EngineCoreOutputs` to
each request's gateway; with nothing to do it sleeps on the worker's wake event. With
async scheduling (the default) each loop keeps two steps in flight, so the worker never
waits for the bus between steps. A monitor declares dead a worker that misses its step
deadline or its heartbeats, cancels its loop, and its requests move to the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass

import msgspec
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from opentelemetry import trace

from services.scheduler.fleet import Fleet, Rejection, WorkerHandle
from services.scheduler.scheduler import Scheduler
from shared.bus import Subjects, connect, encode, stop_on_signals
from shared.config import SchedulerConfig
from shared.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerHeartbeat,
    SchedulerInfo,
    SchedulerOutput,
    WorkerInfo,
)
from shared.tracing import Link, extract, inject, setup_tracing, shutdown_tracing, span_context_of, tracing_enabled

log = logging.getLogger("llmbus.scheduler")


@dataclass(slots=True)
class _InFlight:
    """A step sent to a worker whose answer has not been applied yet."""

    step: SchedulerOutput
    span: trace.Span
    sent_at: float
    reply: asyncio.Future  # -> ModelRunnerOutput | None


class SchedulerService:
    def __init__(
        self,
        nc,
        subjects: Subjects,
        config: SchedulerConfig,
        enable_prefix_caching: bool = True,
        step_timeout_s: float = 120.0,
        heartbeat_timeout_s: float = 2.0,
        no_worker_timeout_s: float = 30.0,
        max_waiting_requests: int = 0,
        async_scheduling: bool = True,
    ) -> None:
        self.nc = nc
        self.async_scheduling = async_scheduling
        self.subjects = subjects
        self.step_timeout_s = step_timeout_s
        self.fleet = Fleet(config, enable_prefix_caching, heartbeat_timeout_s, no_worker_timeout_s,
                           max_waiting_requests)
        self.scheduler_id = uuid.uuid4().hex[:8]
        self.tracer = setup_tracing("scheduler")
        self.tracing = tracing_enabled()
        self._links: dict[str, Link | None] = {}  # request id -> link to its gateway span
        self.wake = asyncio.Event()
        self._request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._abort_decoder = msgspec.msgpack.Decoder(AbortRequests)
        self._worker_decoder = msgspec.msgpack.Decoder(WorkerInfo)
        self._runner_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)

    async def start(self) -> None:
        s = self.subjects
        await self.nc.subscribe(s.requests, cb=self.on_request)
        await self.nc.subscribe(s.abort, cb=self.on_abort)
        await self.nc.subscribe(s.announce, cb=self.on_announce)
        await self.nc.subscribe(s.scheduler_info, cb=self.on_info)
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
        self.wake.set()

    async def on_abort(self, msg) -> None:
        try:
            ids = self._abort_decoder.decode(msg.data).request_ids
        except msgspec.DecodeError:
            return
        self.fleet.abort(ids)
        self.wake.set()  # so the worker hears of it at the next tick

    async def on_announce(self, msg) -> None:
        try:
            info = self._worker_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        await self._publish_rejections(self.fleet.heard_from(info, time.monotonic()))
        self.wake.set()

    async def on_info(self, msg) -> None:
        fleet = self.fleet
        info = SchedulerInfo(
            scheduler_id=self.scheduler_id,
            model=self.subjects.model,
            num_workers=len(fleet.workers),
            max_model_len=fleet.max_model_len,
            stats=fleet.stats() if fleet.workers else None,
        )
        await msg.respond(encode(info))

    async def on_reconnect(self) -> None:
        """Steps in flight across a NATS restart may be lost (a step or its answer), and
        a worker may have applied a step whose answer never came: every worker starts
        afresh. Its requests wait, rejoin with it at its next heartbeat and recompute."""
        for worker_id in list(self.fleet.workers):
            await self._publish_rejections(self.fleet.remove(worker_id, "NATS reconnected"))
        self.wake.set()

    async def _publish_rejections(self, rejections: list[Rejection]) -> None:
        for subject, output in rejections:
            if subject:
                await self.nc.publish(subject, encode(EngineCoreOutputs([output])))

    # ---- the tick loop ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """The monitor: one loop per live worker, dead ones cancelled, waiters expired."""
        loops: dict[str, tuple[WorkerHandle, asyncio.Task]] = {}
        last_heartbeat = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now - last_heartbeat >= 0.5:  # gateways watch this to notice a dead scheduler
                    last_heartbeat = now
                    beat = SchedulerHeartbeat(self.scheduler_id, len(self.fleet.workers))
                    await self.nc.publish(self.subjects.scheduler_heartbeat, encode(beat))
                await self._publish_rejections(self.fleet.check(now))
                for worker_id, (handle, task) in list(loops.items()):
                    if self.fleet.workers.get(worker_id) is not handle:
                        task.cancel()  # removed (dead, drained) or rejoined as a new handle
                        del loops[worker_id]
                for worker_id, handle in self.fleet.workers.items():
                    if worker_id not in loops:
                        loops[worker_id] = (handle, asyncio.create_task(self._worker_loop(handle)))
                await self._sleep(stop, timeout=0.25)
        finally:
            for _, task in loops.values():
                task.cancel()

    async def _worker_loop(self, handle: WorkerHandle) -> None:
        """Keep the worker busy: with async scheduling, step N+1 is built and sent while
        step N runs, so the worker finds its next step waiting when it answers (the bus
        round trip and this loop's own work are hidden behind the forward pass)."""
        core = handle.core
        depth = 2 if self.async_scheduling else 1
        in_flight: deque[_InFlight] = deque()
        try:
            while True:
                if len(in_flight) < depth and core.has_work():
                    step = core.schedule()
                    if step.num_scheduled_tokens or step.finished_req_ids:
                        # A worker new to this core may hold state from before (an earlier
                        # scheduler, or its own false death): its first step clears it.
                        step.reset, handle.needs_reset = handle.needs_reset, False
                        in_flight.append(self._send(handle, step))
                        continue
                if in_flight:
                    landed = await self._land(handle, in_flight[0])
                    in_flight.popleft()
                    if not landed:
                        return  # the worker is gone; the fleet has moved its requests
                elif core.has_work():
                    await asyncio.sleep(0.01)  # nothing fits right now; let the event loop breathe
                else:
                    handle.wake.clear()
                    try:
                        await asyncio.wait_for(handle.wake.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
        finally:
            for sent in in_flight:
                sent.reply.cancel()
                sent.span.end()

    def _send(self, handle: WorkerHandle, step: SchedulerOutput) -> _InFlight:
        span = self._start_step_span(handle.core, step, handle.worker_id)
        headers = inject(trace.set_span_in_context(span))
        reply = asyncio.ensure_future(self._execute(handle, step, headers))
        return _InFlight(step, span, time.monotonic(), reply)

    async def _land(self, handle: WorkerHandle, sent: _InFlight) -> bool:
        """Apply one step's answer; False when the worker did not answer."""
        core, step, span = handle.core, sent.step, sent.span
        runner_output = await sent.reply
        now = time.monotonic()
        # The worker's time on this step: from when it could start it (sent, or the step
        # before it answered) to its answer.
        step_time = now - max(sent.sent_at, handle.last_answer_at)
        handle.last_answer_at = now
        if runner_output is None:  # no answer: the worker is gone, its requests move on
            span.set_status(trace.Status(trace.StatusCode.ERROR, "worker did not answer"))
            span.end()
            await self._publish_rejections(
                self.fleet.remove(handle.worker_id, f"no answer to step {step.step_id}")
            )
            self.wake.set()
            return False
        published = core.update_from_output(step, runner_output)
        stats = msgspec.structs.replace(
            self.fleet.stats(), scheduler_id=self.scheduler_id, worker_id=handle.worker_id, step_time_s=step_time
        )
        for subject, outputs in published.items():
            outputs.scheduler_stats = stats
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.fleet.finished(output.request_id)
                    self._links.pop(output.request_id, None)
            if subject:
                await self.nc.publish(subject, encode(outputs))
        if runner_output.error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, runner_output.error))
        span.end()
        return True

    async def _execute(self, handle: WorkerHandle, step, headers: dict[str, str]) -> ModelRunnerOutput | None:
        """The worker's answer; None when it cannot answer (gone, or past the deadline)."""
        try:
            reply = await self.nc.request(
                self.subjects.step(handle.worker_id), encode(step),
                timeout=self.step_timeout_s, headers=headers or None,
            )
        except (NatsTimeoutError, NoRespondersError, asyncio.TimeoutError) as exc:
            log.error("worker %s did not answer step %d: %s", handle.worker_id, step.step_id, type(exc).__name__)
            return None
        try:
            return self._runner_output_decoder.decode(reply.data)
        except msgspec.DecodeError as exc:
            return ModelRunnerOutput(step.step_id, [], [], error=f"malformed step reply: {exc}")

    async def _sleep(self, stop: asyncio.Event, timeout: float) -> None:
        self.wake.clear()
        waiter = asyncio.ensure_future(self.wake.wait())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({waiter, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        stopper.cancel()

    # ---- tracing ----------------------------------------------------------------------

    def _link_of(self, request) -> Link | None:
        """Parsed once per request, not once per tick."""
        if request.request_id not in self._links:
            span_context = span_context_of(request.trace_headers)
            self._links[request.request_id] = Link(span_context) if span_context is not None else None
        return self._links[request.request_id]

    def _start_step_span(self, core: Scheduler, step: SchedulerOutput, worker_id: str):
        """One span per tick, linked to the requests it served rather than copied into each.

        Its parent is the oldest request's context, so a request traced alone shows its
        whole path (and every step's worker span) in one trace.
        """
        if not self.tracing:
            return trace.INVALID_SPAN
        now_ns = time.time_ns()
        requests = [core.requests[r] for r in step.num_scheduled_tokens if r in core.requests]
        num_prefill_tokens = num_decodes = 0
        for request in requests:
            n = step.num_scheduled_tokens[request.request_id]
            before = request.num_computed_tokens - n  # the core counted this step already
            if before < request.num_prompt_tokens:
                num_prefill_tokens += n
            else:
                num_decodes += 1
            if request.queue_time_s is not None and not request.queue_time_traced:
                request.queue_time_traced = True
                queued = self.tracer.start_span(
                    "scheduler.queue", context=extract(request.trace_headers),
                    start_time=now_ns - int(request.queue_time_s * 1e9),
                )
                queued.end(end_time=now_ns)
        links = [link for r in requests if (link := self._link_of(r)) is not None]
        oldest = min(requests, key=lambda r: r.queued_at, default=None)
        stats = core.make_stats()
        return self.tracer.start_span(
            "scheduler.step",
            context=extract(oldest.trace_headers) if oldest else None,
            links=links,
            attributes={
                "llmbus.step_id": step.step_id,
                "llmbus.worker_id": worker_id,
                "llmbus.num_requests": len(requests),
                "llmbus.num_scheduled_tokens": step.total_num_scheduled_tokens,
                "llmbus.num_prefill_tokens": num_prefill_tokens,
                "llmbus.num_decode_requests": num_decodes,
                "llmbus.kv_cache_usage": stats.kv_cache_usage,
                "llmbus.num_preemptions": stats.num_preemptions,
            },
        )


async def serve(
    nats_url: str,
    model_name: str,
    config: SchedulerConfig,
    ready: asyncio.Event | None = None,
    **options,
) -> None:
    """`options` are SchedulerService's keyword arguments (timeouts, limits, caching)."""
    holder: list[SchedulerService] = []

    async def on_reconnect() -> None:
        if holder:
            await holder[0].on_reconnect()

    nc = await connect(nats_url, "scheduler", on_reconnect)
    service = SchedulerService(nc, Subjects(model_name), config, **options)
    holder.append(service)
    await service.start()
    stop = stop_on_signals()
    log.info("scheduler %s ready", service.scheduler_id)
    if ready is not None:
        ready.set()
    await service.run(stop)
    await nc.drain()
    shutdown_tracing()
