"""What each scheduler shard's workers hold in their prefix caches, as the shards' KV events
say (--kv-events-config; shared/kv_events.py): the published state every gateway reads
alike, so gateways that route by it reach the same choice for the same prompt.

A plain object: the engine client feeds it the batches and snapshots it receives and asks
for a snapshot where it says batches were missed; the router asks how many of a prompt's
leading blocks one worker of a shard holds."""

from __future__ import annotations

from collections.abc import Sequence

from shared.block_hashes import prompt_block_hashes
from shared.kv_events import BlockStored, KVEventBatch, KVEventIndex, KVEventSnapshot
from shared.prefix_affinity import MAX_BLOCKS


class ShardCaches:
    def __init__(self) -> None:
        self.indexes: dict[int, KVEventIndex] = {}
        self.block_size: int | None = None  # (the cache's, as its BlockStored events give it)

    def apply(self, batch: KVEventBatch) -> bool:
        """A shard's next batch; False where batches were missed: ask that shard for a snapshot."""
        self._learn(batch)
        return self.indexes.setdefault(batch.data_parallel_rank or 0, KVEventIndex()).apply(batch)

    def apply_snapshot(self, snapshot: KVEventSnapshot) -> None:
        for batch in snapshot.batches:
            self._learn(batch)
        self.indexes.setdefault(snapshot.data_parallel_rank or 0, KVEventIndex()).apply_snapshot(snapshot)

    def forget(self, rank: int) -> None:
        """A shard a new scheduler took over, or one gone: what it said no longer holds."""
        self.indexes.pop(rank, None)

    def chain(self, token_ids: Sequence[int], cache_salt: str | None = None, mm_features=()) -> list[bytes]:
        """The prompt's leading block hashes as the shards' caches key them ([] before any
        event): its first MAX_BLOCKS, as the gateway's memory of sent prompts keeps (a
        digest a block on every request's path: a 32k-token prompt's whole chain would be
        2,000 of them)."""
        if self.block_size is None:
            return []
        return prompt_block_hashes(token_ids[:MAX_BLOCKS * self.block_size], self.block_size, cache_salt,
                                   mm_features=mm_features)

    def cached_blocks(self, rank: int, chain: list[bytes]) -> int:
        """How many leading blocks of `chain` one worker of shard `rank` holds (the most any does)."""
        index = self.indexes.get(rank)
        best = 0
        for held in (index.blocks.values() if index is not None else ()):
            depth = 0
            while depth < len(chain) and chain[depth] in held:
                depth += 1
            best = max(best, depth)
        return best

    def _learn(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.block_size:
                self.block_size = event.block_size
