"""A shard's KV events on the bus (shared/kv_events.py): each worker's pool records what
enters and leaves its prefix cache; after each landed step (and twice a second) what was
recorded goes out as one numbered batch a worker, and a snapshot is answered on request,
after the batches before it went out."""

from __future__ import annotations

import time

from services.scheduler.shell.fleet import WorkerHandle
from shared.bus import Subjects, encode
from shared.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, KVEventSnapshot


class KVEventPublisher:
    def __init__(self, nc, subjects: Subjects, rank: int, workers: dict[str, WorkerHandle]) -> None:
        """`workers`: the shard's (Fleet.workers, read at each flush)."""
        self.nc = nc
        self.workers = workers
        self.subject = subjects.kv_events(rank)
        self.snapshot_subject = subjects.kv_snapshot(rank)
        self.rank = rank
        self.seq = 0
        self._watched: dict[str, WorkerHandle] = {}
        self._gone: list[str] = []  # workers removed since the last flush: their caches went with them

    async def start(self) -> None:
        await self.nc.subscribe(self.snapshot_subject, cb=self.on_snapshot)

    def sync(self) -> None:
        """Watch workers that joined (their pools record from the start: Fleet(kv_events=True));
        say a cleared cache for those that left (one that rejoins starts with an empty pool)."""
        for worker_id, handle in list(self._watched.items()):
            if self.workers.get(worker_id) is not handle:
                del self._watched[worker_id]
                self._gone.append(worker_id)
        for worker_id, handle in self.workers.items():
            if worker_id not in self._watched:
                self._watched[worker_id] = handle

    async def flush(self) -> None:
        self.sync()
        now = time.time()
        gone, self._gone = self._gone, []
        for worker_id in gone:
            await self._send(KVEventBatch(now, [AllBlocksCleared()], self.rank, worker_id))
        # (a copy: another flush may change the watched set while this one publishes)
        for worker_id, handle in list(self._watched.items()):
            events = handle.core.kv_cache_manager.block_pool.take_events()
            if events:
                await self._send(KVEventBatch(now, events, self.rank, worker_id))

    async def _send(self, batch: KVEventBatch) -> None:
        self.seq += 1
        batch.seq = self.seq
        await self.nc.publish(self.subject, encode(batch))

    async def on_snapshot(self, msg) -> None:
        """Every worker's cached blocks, as of the last batch: what came before goes out first."""
        await self.flush()
        now = time.time()
        batches = [KVEventBatch(now, [AllBlocksCleared(), BlockStored(
            handle.core.kv_cache_manager.block_pool.cached_blocks(), None, [],
            handle.core.kv_cache_manager.block_size)], self.rank, worker_id)
            for worker_id, handle in self._watched.items()]
        await msg.respond(encode(KVEventSnapshot(self.seq, batches, self.rank)))
