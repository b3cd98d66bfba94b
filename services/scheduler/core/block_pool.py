"""The pool of KV-cache blocks of one worker: reference counts, free queue, prefix cache.

Only integers and hashes live here; the tensors are on the worker. A block whose
reference count drops to zero goes to the back of the free queue but keeps its hash,
so a later request with the same prefix can take it back (prefix caching); the front of
the queue is evicted first, which makes cached blocks evictable in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.block_hashes import BlockHash, hash_block_tokens  # noqa: F401 - (the pool's keys; named here too)
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Front is evicted first. An OrderedDict gives O(1) pop-front, append and removal.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        # KV events (--kv-events-config): what entered and left the prefix cache since the
        # shell last took them; None while nobody publishes them
        self.events: list[KVCacheEvent] | None = None

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events or [], ([] if self.events is not None else None)
        return events

    def cached_blocks(self) -> list[BlockHash]:
        return list(self._cached)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free queue in the order given,
        so callers pass a request's blocks tail first: its last blocks are evicted first."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:  # checked before the decrement: never negative
                raise AssertionError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash, parent_hash: BlockHash | None = None,
                         token_ids: Sequence[int] = (), lora_id: int | None = None) -> None:
        """(parent_hash, token_ids, lora_id: for the KV event that says so)"""
        if not self.enable_caching or block.block_hash is not None:
            return
        # Two requests may compute the same prefix at once; the first one registered wins
        # and the other block simply stays private.
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
            if self.events is not None:
                self.events.append(BlockStored([block_hash], parent_hash, list(token_ids), len(token_ids), lora_id))

    def uncache(self, block: KVCacheBlock) -> None:
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([block.block_hash]))
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True
