"""KV cache events, vLLM's (`--kv-events-config`): which blocks each worker's prefix cache
holds, as batches of `BlockStored`, `BlockRemoved` and `AllBlocksCleared`, so that a router
— our gateways, or an external one such as Dynamo's or llm-d's — can send a request where
its prefix is cached. vLLM publishes them over ZMQ; a scheduler here publishes them on the
bus (`llmbus.<model>.kv_events.<shard>`), each batch numbered so that a consumer notices
a gap, and answers for a snapshot of every worker's cached blocks (`kv_events.snapshot`).
A consumer that applies a snapshot and then the batches numbered after it holds each
worker's cached set exactly (`KVEventIndex`).

The structs keep vLLM's names and fields (tagged as its are, so a union decodes); block
hashes are the scheduler's own chained blake2b digests (services/scheduler/core/
block_pool.py), and each batch says which worker's pool it describes.
"""

from __future__ import annotations

import json
from typing import Union

import msgspec

_EVENT = dict(array_like=True, omit_defaults=True, gc=False, tag=True)


class BlockStored(msgspec.Struct, **_EVENT):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, **_EVENT):
    block_hashes: list[bytes]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, **_EVENT):
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None
    worker_id: str = ""  # whose pool (ours: one pool a worker, a shard many workers)
    seq: int = 0  # the shard's batches in order, from 1; a snapshot says the last it covers


class KVEventSnapshot(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A shard's every worker's cached blocks as of batch `seq` (as BlockStored batches)."""

    seq: int
    batches: list[KVEventBatch]
    data_parallel_rank: int = 0


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's --kv-events-config. Its ZMQ endpoints have no use here: the bus carries the
    events (`publisher` "nats"; vLLM's "null" turns them off)."""

    enable_kv_cache_events: bool = False
    publisher: str = "nats"

    @classmethod
    def parse(cls, text: str | dict | None) -> "KVEventsConfig | None":
        """None when off; a key or publisher llmbus does not know is a ValueError naming it."""
        if text is None or text == "":
            return None
        raw = json.loads(text) if isinstance(text, str) else text
        try:
            config = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from None
        if config.publisher not in ("nats", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r}: llmbus publishes KV events on "
                             "its bus (\"nats\"), not over ZMQ")
        return config if config.enable_kv_cache_events and config.publisher == "nats" else None


class KVEventIndex:
    """A consumer's view: worker id -> the block hashes its prefix cache holds."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[bytes]] = {}
        self.seq = 0

    def apply_snapshot(self, snapshot: KVEventSnapshot) -> None:
        self.blocks = {}
        for batch in snapshot.batches:
            self._apply(batch)
        self.seq = snapshot.seq

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply the next batch; False (nothing applied) when batches were missed or it is
        an old one: then ask for a snapshot."""
        if batch.seq <= self.seq:
            return True
        if batch.seq != self.seq + 1:
            return False
        self._apply(batch)
        self.seq = batch.seq
        return True

    def _apply(self, batch: KVEventBatch) -> None:
        held = self.blocks.setdefault(batch.worker_id, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()
