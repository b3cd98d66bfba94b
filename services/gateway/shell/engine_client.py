"""The gateway's side of the bus: tokenize, submit, receive outputs, abort.

One subscription on this gateway's outputs subject fans `EngineCoreOutput`s out to
the queue of the request they belong to; the HTTP handlers only ever see queues.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from services.gateway.errors import BadRequest, Unavailable
from services.gateway.output_queue import OutputQueue
from services.gateway.shard_router import ShardRouter
from services.gateway.shell.stream_ledger import StreamLedger
from shared.bus import Subjects, encode
from shared.kv_events import KVEventBatch, KVEventSnapshot
from shared.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GatewayHeartbeat,
    PromptWithImages,
    SchedulerHeartbeat,
    SchedulerInfo,
    SchedulerStats,
    TokenizeRequest,
    TokenizeResponse,
)

log = logging.getLogger("llmbus.gateway")


class EngineClient:
    def __init__(
        self, nc, subjects: Subjects, gateway_id: str, timeout_s: float = 10.0, on_stats=None,
        scheduler_timeout_s: float = 2.5, resume_timeout_s: float = 30.0, group: str = "",
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.gateway_id = gateway_id
        # This process's own: a gateway restarted under the same id (its bus identity)
        # reads none of the dead one's outputs, and the scheduler tells the two apart.
        self.reply_subject = subjects.outputs(gateway_id, uuid.uuid4().hex[:8])
        self.group = group  # its sibling gateways' (peers.py)
        self._heartbeat = encode(GatewayHeartbeat(self.reply_subject, group))
        self.timeout_s = timeout_s
        self._queues: dict[str, OutputQueue] = {}
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._tokenize_decoder = msgspec.msgpack.Decoder(TokenizeResponse)
        self._info_decoder = msgspec.msgpack.Decoder(SchedulerInfo)
        self._info: SchedulerInfo | None = None
        self._info_at = 0.0
        self._on_stats = on_stats  # called with each SchedulerStats that arrives
        self._background: set[asyncio.Task] = set()
        self._heartbeat_decoder = msgspec.msgpack.Decoder(SchedulerHeartbeat)
        self._stats_decoder = msgspec.msgpack.Decoder(SchedulerStats)
        self._kv_events_decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._kv_snapshot_decoder = msgspec.msgpack.Decoder(KVEventSnapshot)
        self._snapshotting: set[int] = set()  # shards a KV event snapshot was asked of
        self.scheduler_timeout_s = scheduler_timeout_s
        # How long in-flight requests wait for a scheduler to resume them on.
        self.resume_timeout_s = resume_timeout_s
        self.ledger = StreamLedger()
        # The scheduler shards (--data-parallel-size) as their heartbeats tell: where each
        # request goes, and which requests to send again when a shard changes hands.
        self.router = ShardRouter(scheduler_timeout_s)
        self._last_heartbeat: float | None = None
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> None:
        await self.nc.subscribe(self.reply_subject, cb=self._on_outputs)
        await self.nc.subscribe(self.subjects.scheduler_stats, cb=self._on_scheduler_stats)
        await self.nc.subscribe(self.subjects.scheduler_heartbeat, cb=self._on_heartbeat)
        await self.nc.subscribe(self.subjects.kv_events("*"), cb=self._on_kv_events)
        await self.nc.flush()
        # Counted from now: a scheduler that never speaks is as silent as one that stopped.
        self._last_heartbeat = time.monotonic()
        self._watchdog = asyncio.get_running_loop().create_task(self._keep_watch())

    # ---- scheduler liveness -------------------------------------------------------------

    async def _on_heartbeat(self, msg) -> None:
        try:
            beat = self._heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self._last_heartbeat = time.monotonic()
        why = self.router.heard(beat, self._last_heartbeat)
        if why is not None:
            # A new scheduler knows nothing of what the old one was running, and one that
            # reconnected to NATS may have lost outputs in the gap: the shard's unfinished
            # requests are sent again, resumed from the tokens already streamed.
            await self._resume(self.ledger.on_shard(beat.data_parallel_rank), why)

    def scheduler_silent(self) -> bool:
        """True when no scheduler has been heard for too long (or at all since start)."""
        return self._last_heartbeat is not None and time.monotonic() - self._last_heartbeat > self.scheduler_timeout_s

    async def _keep_watch(self) -> None:
        """This gateway's heartbeat, twice a second: the scheduler drops the requests of a
        gateway it no longer hears (gateways.py). And requests in flight wait for a
        scheduler to come back (and resume them) for a bounded time; past it they end with
        a clear error rather than hang."""
        bound = self.scheduler_timeout_s + self.resume_timeout_s
        beat_at = 0.0
        while True:
            if time.monotonic() - beat_at >= 0.5 and self.nc.is_connected:
                beat_at = time.monotonic()
                await self.nc.publish(self.subjects.gateway_heartbeat, self._heartbeat)
            await asyncio.sleep(0.25)
            await self._move_off_silent_shards()
            silent_for = time.monotonic() - self._last_heartbeat
            if silent_for > bound and self._queues:
                self._fail_open_requests(f"no scheduler has been heard from for {silent_for:.1f} s")

    async def _move_off_silent_shards(self) -> None:
        """A shard gone silent (its scheduler died, and none has taken its place yet) while
        others serve: its requests resume on them. (Alone, they wait for it to come back.)"""
        now = time.monotonic()
        if not self.router.live(now):
            return
        for rank in self.router.silent(now):
            moved = self.ledger.on_shard(rank)
            if moved:
                log.warning("scheduler shard %d silent for %.1f s: resuming its %d request(s) on the others", rank,
                            self.router.timeout_s, len(moved))
                # (should it be alive after all, it drops them rather than run them twice)
                await self._publish_abort(rank, moved)
                await self._resume(moved, "", reroute=True)

    async def on_reconnect(self) -> None:
        """Outputs (and submits) sent while this gateway was away from the bus are lost:
        every open request resumes, and the scheduler sends again what it lacks."""
        await self._resume(None, "this gateway reconnected to NATS")

    async def _resume(self, request_ids: list[str] | None, why: str, reroute: bool = False) -> None:
        """Send requests again as resumes, each to its shard (`reroute`: to a shard chosen
        afresh)."""
        resumed = self.ledger.resumed(request_ids)
        if resumed and why:
            log.warning("%s; resuming %d request(s)", why, len(resumed))
        for request in resumed:
            rank = self.ledger.shard.get(request.request_id, 0)
            if reroute:
                rank = self._route(request)
                self.ledger.shard[request.request_id] = rank
            await self.nc.publish(self.subjects.requests(rank), encode(request))

    def _route(self, request: EngineCoreRequest) -> int:
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        held = Counter(self.ledger.shard.values())  # (this gateway's open requests, by shard)
        return self.router.route(request.prompt_token_ids, lora, time.monotonic(), held, request.cache_salt,
                                 request.mm_features)

    def _fail_open_requests(self, reason: str) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(EngineCoreOutput(request_id, [], FinishReason.UNAVAILABLE, error=reason))

    async def _on_kv_events(self, msg) -> None:
        """A shard's KV events (where it publishes them: --kv-events-config): what its
        workers' prefix caches hold, for routing; a missed batch asks for a snapshot."""
        try:
            batch = self._kv_events_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        rank = batch.data_parallel_rank or 0
        if not self.router.caches.apply(batch) and rank not in self._snapshotting:
            self._snapshotting.add(rank)
            task = asyncio.get_running_loop().create_task(self._kv_snapshot(rank))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _kv_snapshot(self, rank: int) -> None:
        try:
            reply = await self.nc.request(self.subjects.kv_snapshot(rank), b"", timeout=2.0)
            self.router.caches.apply_snapshot(self._kv_snapshot_decoder.decode(reply.data))
        except (NatsTimeoutError, NoRespondersError, msgspec.DecodeError) as exc:
            log.info("no KV event snapshot from shard %d (%s): routing by this gateway's memory meanwhile",
                     rank, type(exc).__name__)
        finally:
            self._snapshotting.discard(rank)

    async def _on_scheduler_stats(self, msg) -> None:
        try:
            stats = self._stats_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self._saw_stats(stats)

    def _saw_stats(self, stats: SchedulerStats) -> None:
        """A shard's figures, on their subject or with its outputs: its load for routing,
        and the metrics."""
        self.router.reported(stats.data_parallel_rank, stats.num_running_reqs + stats.num_waiting_reqs)
        if self._on_stats is not None:
            self._on_stats(stats)

    async def _on_outputs(self, msg) -> None:
        try:
            outputs = self._outputs_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("dropped malformed outputs")
            return
        if outputs.resume_all:  # (after every output sent before it: the ledger is up to date)
            await self._resume(None, "the scheduler dropped this gateway's requests while it did not hear it")
        if outputs.scheduler_stats is not None:
            self._saw_stats(outputs.scheduler_stats)
        gaps = []
        for output in outputs.outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue
            fresh, gap = self.ledger.received(output)
            if gap:
                gaps.append(output.request_id)
            if fresh is not None:
                queue.put_nowait(fresh)
        if gaps:
            await self._resume(gaps, "")  # (quietly: a bus that lost a message)

    # ---- calls ------------------------------------------------------------------------

    async def tokenize(
        self, request: TokenizeRequest, headers: dict[str, str] | None = None, attempts: int = 3,
        timeout_s: float | None = None,
    ) -> list[int]:
        """Ask a tokenizer replica; if it does not answer (it died holding the request),
        ask again: the queue group routes the retry to a live replica. `timeout_s`: the
        whole wait (default the client's), shared by the attempts."""
        payload = encode(request)
        timeout_s = timeout_s or self.timeout_s
        for attempt in range(attempts):
            try:
                reply = await self.nc.request(
                    self.subjects.tokenize, payload, timeout=timeout_s / attempts, headers=headers or None
                )
                break
            except NoRespondersError as exc:  # none subscribed right now: a short wait may help
                if attempt == attempts - 1:
                    raise Unavailable("no tokenizer is running") from exc
                await asyncio.sleep(0.2)
            except (NatsTimeoutError, asyncio.TimeoutError) as exc:
                if attempt == attempts - 1:
                    raise Unavailable(f"no tokenizer answered in {timeout_s:.0f} s") from exc
        response = self._tokenize_decoder.decode(reply.data)
        if response.error is not None:
            raise BadRequest(response.error, "messages" if request.messages is not None else "prompt")
        return PromptWithImages(response.token_ids, response.mm_features) if response.mm_features \
            else response.token_ids

    async def scheduler_info(self, max_age_s: float = 2.0) -> SchedulerInfo:
        """The deployment's scheduler: every live shard's answer, combined."""
        now = time.monotonic()
        if self._info is not None and now - self._info_at < max_age_s:
            return self._info
        shards = len(self.router.live(now))
        timeout = min(self.timeout_s, 2.0)
        try:
            if shards <= 1:  # (a request: no responder is an answer at once)
                reply = await self.nc.request(self.subjects.scheduler_info, b"", timeout=timeout)
                infos = [self._info_decoder.decode(reply.data)]
            else:
                infos = await self._ask_every_shard(shards, timeout)
        except (NatsTimeoutError, NoRespondersError, asyncio.TimeoutError) as exc:
            self._info = None
            raise Unavailable(f"no scheduler answered ({type(exc).__name__})") from exc
        for info in infos:
            self.router.answered(info.data_parallel_rank, info.num_workers)
        self._info, self._info_at = SchedulerInfo.combine(infos), now
        return self._info

    async def _ask_every_shard(self, shards: int, timeout: float) -> list[SchedulerInfo]:
        """Each shard answers the one question: the answers until all `shards` have (or
        the timeout, with some)."""
        infos: dict[int, SchedulerInfo] = {}
        all_in = asyncio.Event()

        async def on_reply(msg) -> None:
            info = self._info_decoder.decode(msg.data)
            infos[info.data_parallel_rank] = info
            if len(infos) >= shards:
                all_in.set()

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            await self.nc.publish(self.subjects.scheduler_info, b"", reply=inbox)
            try:
                await asyncio.wait_for(all_in.wait(), timeout)
            except asyncio.TimeoutError:
                if not infos:
                    raise
        finally:
            await sub.unsubscribe()
        return [infos[rank] for rank in sorted(infos)]

    def open(self, request_ids: list[str], queue: OutputQueue) -> None:
        for request_id in request_ids:
            self._queues[request_id] = queue

    def close(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._queues.pop(request_id, None)
        self.ledger.forget(request_ids)

    async def submit(self, request: EngineCoreRequest) -> None:
        rank = self._route(request)
        self.ledger.submitted(request, rank)
        await self.nc.publish(self.subjects.requests(rank), encode(request))

    def abort_soon(self, request_ids: list[str]) -> None:
        """Abort from anywhere, even a cancelled task's cleanup: the publish runs on its own."""
        if not request_ids:
            return
        by_shard: dict[int, list[str]] = {}
        for request_id in request_ids:
            by_shard.setdefault(self.ledger.shard.get(request_id, 0), []).append(request_id)
        self.ledger.forget(request_ids)
        for rank, ids in by_shard.items():
            task = asyncio.get_running_loop().create_task(self._publish_abort(rank, ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _publish_abort(self, rank: int, request_ids: list[str]) -> None:
        await self.nc.publish(self.subjects.abort(rank), encode(AbortRequests(list(request_ids))))
