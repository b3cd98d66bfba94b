"""Which scheduler shard (--data-parallel-rank) a worker joins, and which shard a prompt's
prefix belongs to: rendezvous hashing, so every process that asks — each gateway, each
worker — reaches the same answer from the same inputs with nothing shared, and a shard
that comes or goes moves only the keys that were (or become) its own."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _weight(key: bytes, rank: int) -> int:
    return int.from_bytes(hashlib.blake2b(key + rank.to_bytes(4, "little"), digest_size=8).digest(), "little")


def rendezvous(key: bytes | str, ranks: Iterable[int]) -> int:
    """The rank of `ranks` whose hash with `key` is highest (the first of them if none)."""
    data = key.encode() if isinstance(key, str) else key
    return max(ranks, key=lambda rank: _weight(data, rank))


def shard_of(worker_id: str, data_parallel_size: int, data_parallel_rank: int | None = None) -> int:
    """A worker's shard: the one it was given, else one chosen by a hash of its id."""
    if data_parallel_rank is not None:
        return data_parallel_rank
    return rendezvous(worker_id, range(data_parallel_size))
