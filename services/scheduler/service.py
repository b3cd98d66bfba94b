"""The scheduler service: the tick loop around the scheduler core.

Requests and aborts arrive from gateways between ticks (the same event loop, so the
core is never touched concurrently). A tick: `schedule()` -> the `SchedulerOutput` to
the worker as a NATS request -> its `ModelRunnerOutput` -> `update_from_output()` ->
`EngineCoreOutputs` published to each request's gateway. With nothing to do the loop
sleeps on an event; a step reply that never comes is a timeout that fails that step's
requests, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
from nats.errors import NoRespondersError, TimeoutError as NatsTimeoutError
from opentelemetry import trace

from services.scheduler.scheduler import Scheduler
from shared.bus import Subjects, connect, encode, stop_on_signals
from shared.config import SchedulerConfig
from shared.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerInfo,
    WorkerInfo,
)
from shared.tracing import Link, extract, inject, setup_tracing, shutdown_tracing, span_context_of, tracing_enabled

log = logging.getLogger("llmbus.scheduler")


class SchedulerService:
    def __init__(
        self,
        nc,
        subjects: Subjects,
        config: SchedulerConfig,
        enable_prefix_caching: bool = True,
        step_timeout_s: float = 120.0,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.config = config
        self.enable_prefix_caching = enable_prefix_caching
        self.step_timeout_s = step_timeout_s
        self.scheduler_id = uuid.uuid4().hex[:8]
        self.tracer = setup_tracing("scheduler")
        self.tracing = tracing_enabled()
        self._links: dict[str, Link | None] = {}  # request id -> link to its gateway span
        self.core: Scheduler | None = None
        self.worker: WorkerInfo | None = None
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
        if self.core is None:
            await self._reject(request, "no worker has joined yet", FinishReason.ERROR)
            return
        try:
            self.core.add_request(request)
        except ValueError as exc:
            await self._reject(request, str(exc), FinishReason.REJECTED)
            return
        self.wake.set()

    async def _reject(self, request: EngineCoreRequest, reason: str, finish: FinishReason) -> None:
        output = EngineCoreOutput(request.request_id, [], finish, error=reason)
        if request.reply_subject:
            await self.nc.publish(request.reply_subject, encode(EngineCoreOutputs([output])))

    async def on_abort(self, msg) -> None:
        try:
            ids = self._abort_decoder.decode(msg.data).request_ids
        except msgspec.DecodeError:
            return
        if self.core is not None:
            self.core.abort_requests(ids)
            self.wake.set()  # so the worker hears of it at the next tick

    async def on_announce(self, msg) -> None:
        try:
            info = self._worker_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self.worker is None:
            self.worker = info
            self.config.max_model_len = min(self.config.max_model_len, info.max_model_len)
            self.core = Scheduler(
                self.config, info.num_kv_blocks, info.block_size, info.vocab_size,
                self.enable_prefix_caching,
            )
            log.info("worker %s joined: %d KV blocks", info.worker_id, info.num_kv_blocks)
            self.wake.set()

    async def on_info(self, msg) -> None:
        info = SchedulerInfo(
            scheduler_id=self.scheduler_id,
            model=self.subjects.model,
            num_workers=0 if self.worker is None else 1,
            max_model_len=self.core.max_model_len if self.core else 0,
            stats=self.core.make_stats() if self.core else None,
        )
        await msg.respond(encode(info))

    # ---- the tick loop ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            core = self.core
            if core is None or not core.has_work():
                await self._sleep(stop)
                continue
            scheduler_output = core.schedule()
            if not scheduler_output.num_scheduled_tokens and not scheduler_output.finished_req_ids:
                await self._sleep(stop, timeout=0.05)
                continue
            span = self._start_step_span(core, scheduler_output)
            started = time.monotonic()
            runner_output = await self._execute(scheduler_output, inject(trace.set_span_in_context(span)))
            step_time = time.monotonic() - started
            published = core.update_from_output(scheduler_output, runner_output)
            for subject, outputs in published.items():
                stats = outputs.scheduler_stats  # one object shared by every subject's message
                stats.scheduler_id, stats.step_time_s = self.scheduler_id, step_time
                stats.worker_id = self.worker.worker_id if self.worker else ""
                if subject:
                    await self.nc.publish(subject, encode(outputs))
            if runner_output.error is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, runner_output.error))
            span.end()
            if self._links:
                for request_id in [r for r in self._links if r not in core.requests]:
                    del self._links[request_id]

    def _link_of(self, request) -> Link | None:
        """Parsed once per request, not once per tick."""
        link = self._links.get(request.request_id)
        if link is None and request.request_id not in self._links:
            span_context = span_context_of(request.trace_headers)
            link = Link(span_context) if span_context is not None else None
            self._links[request.request_id] = link
        return link

    def _start_step_span(self, core: Scheduler, scheduler_output):
        """One span per tick, linked to the requests it served rather than copied into each.

        Its parent is the oldest request's context, so a request traced alone shows its
        whole path (and every step's worker span) in one trace.
        """
        if not self.tracing:
            return trace.INVALID_SPAN
        now_ns = time.time_ns()
        requests = [core.requests[r] for r in scheduler_output.num_scheduled_tokens if r in core.requests]
        num_prefill_tokens = num_decodes = 0
        for request in requests:
            n = scheduler_output.num_scheduled_tokens[request.request_id]
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
                "llmbus.step_id": scheduler_output.step_id,
                "llmbus.num_requests": len(requests),
                "llmbus.num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
                "llmbus.num_prefill_tokens": num_prefill_tokens,
                "llmbus.num_decode_requests": num_decodes,
                "llmbus.kv_cache_usage": stats.kv_cache_usage,
                "llmbus.num_preemptions": stats.num_preemptions,
            },
        )

    async def _execute(self, scheduler_output, headers: dict[str, str]) -> ModelRunnerOutput:
        assert self.worker is not None
        try:
            reply = await self.nc.request(
                self.subjects.step(self.worker.worker_id), encode(scheduler_output),
                timeout=self.step_timeout_s, headers=headers or None,
            )
            return self._runner_output_decoder.decode(reply.data)
        except (NatsTimeoutError, NoRespondersError, asyncio.TimeoutError) as exc:
            reason = f"worker {self.worker.worker_id} did not answer step {scheduler_output.step_id}: {type(exc).__name__}"
        except msgspec.DecodeError as exc:
            reason = f"malformed step reply: {exc}"
        log.error(reason)
        return ModelRunnerOutput(scheduler_output.step_id, [], [], error=reason)

    async def _sleep(self, stop: asyncio.Event, timeout: float = 1.0) -> None:
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
    enable_prefix_caching: bool = True,
    step_timeout_s: float = 120.0,
    ready: asyncio.Event | None = None,
) -> None:
    nc = await connect(nats_url, "scheduler")
    service = SchedulerService(nc, Subjects(model_name), config, enable_prefix_caching, step_timeout_s)
    await service.start()
    stop = stop_on_signals()
    log.info("scheduler %s ready", service.scheduler_id)
    if ready is not None:
        ready.set()
    await service.run(stop)
    await nc.drain()
    shutdown_tracing()
