"""The host's KV tier as a worker sees it (--kv-offloading-size; vLLM's native CPU offloading):
slots of one KV block each, every attention layer's keys and values of the block in one
contiguous run, in a shared-memory file every worker of the host maps. The scheduler keeps
the index (services/scheduler/core/kv_tier_index.py) and orders the copies in each step:
loads into the worker's blocks before the forward, stores out of them after it. Copies are
of bytes, so a block loaded is bit-identical to the block stored.

Each slot's checksum (the int64 sum of its bytes, wrapping) is written with it and checked
when it is loaded: a block that is not what was stored - a bug in the ordering of copies, or
memory gone bad - is reported (`load` returns its block) and never used; the scheduler
computes the requests that read it again.

With --kv-offloading-disk-path, a second file of the same layout on that disk holds the
blocks the host tier gives up (`disk`): the index numbers its slots after the host's, a
store first moves the block its slot held there (`kv_tier_moves`), and a load reads
either file.

The file's first bytes name the layout (slot bytes, slots); a worker whose layout differs
from the file's (another model or cache dtype on the same name) serves without the tier
rather than read blocks it would misread. A file is never shrunk or cleared while workers
map it: the scheduler's index, not the bytes, says what is valid.
"""

from __future__ import annotations

import logging
import os
import socket

import numpy as np
import torch

from services.worker.kv_transfer import TierServer, fetch_slots
from services.worker.parallel.group import current_group

log = logging.getLogger("llmbus.worker")

_MAGIC = b"llmbus-kv-tier-3"
_PAGE = 4096


def _runs(orders: dict[int, int]) -> list[tuple[int, int, int]] | None:
    """(first block, first slot, length) of each run where both go up by one, or None where
    runs are too many to pay a copy each (a block's layers are a copy each already)."""
    runs: list[list[int]] = []
    for block, slot in sorted(orders.items()):
        if runs and block == runs[-1][0] + runs[-1][2] and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([block, slot, 1])
    return [tuple(r) for r in runs] if len(runs) * 4 <= len(orders) else None


def _dims_order(cache: torch.Tensor) -> list[int]:
    """A [K|V, blocks, ...] cache's dims but the blocks', outermost in memory first."""
    return sorted((d for d in range(cache.dim()) if d != 1), key=lambda d: -cache.stride(d))


def _block_major(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, ...] with the other dims in the order they lie in memory (a view)."""
    return cache.permute(1, *_dims_order(cache))


def _as_words(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bits as the widest integers its rows divide into."""
    row_bytes = cache.shape[-1] * cache.element_size()
    dtype = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % d.itemsize == 0)
    return cache.view(torch.uint8).view(dtype)


def _header_bytes(num_slots: int) -> int:
    """The layout (64 bytes), the slots' checksums, to a page boundary; then the slots."""
    return -(-(64 + 8 * num_slots) // _PAGE) * _PAGE


class HostKVTier:
    def __init__(self, caches: list, size_bytes: int, path: str | None, disk_size: int | None = None,
                 disk_folder: str | None = None, flag: str = "--kv-offloading-size") -> None:
        """`caches`: the worker's (an attention layer's [K|V, num_blocks, ...] tensor; the
        others' entries, state or None, have no blocks); `path` None: a tier of this process
        alone (the offline LLM's). `disk_size` bytes in `disk_folder`: the disk tier behind
        it, its file named after the host tier's (a process's own: removed as it is mapped,
        so it goes when the process does)."""
        self.flag = flag
        # Each attention layer's cache, block first, its other dims in the order they lie in
        # memory (the torch backend keeps heads outside positions), so a slot holds a block's
        # bytes as the cache does and a copy moves whole runs; as raw words (copies are of
        # bits, whatever the dtype: fp8 has no index_copy_ of its own, and 8-byte words copy
        # ~4x faster than bytes). A latent cache's keys are its values, one memory expanded
        # to [2, ...]: copied once.
        self.layers = [_block_major(_as_words(c[:1] if c.shape[0] > 1 and c.stride(0) == 0 else c))
                       for c in caches if isinstance(c, torch.Tensor)]
        self.layer_bytes = [c[0].numel() * c.element_size() for c in self.layers]
        # (the order of the first layer's dims, in the file's layout: a worker whose cache
        # lies otherwise - another attention backend - reads it as another layout)
        self.order = _dims_order(_as_words(next(c for c in caches if isinstance(c, torch.Tensor))))
        self.slot_bytes = sum(self.layer_bytes)
        self.num_slots = size_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"{flag} ({size_bytes / (1 << 30):g} GiB) holds no KV block of this model "
                             f"({self.slot_bytes / (1 << 20):.1f} MiB a block)")
        self.path = path
        if path is None:
            whole = torch.zeros(_header_bytes(self.num_slots) + self.num_slots * self.slot_bytes, dtype=torch.uint8)
            self.name = f"{socket.gethostname()}:pid{os.getpid()}"
        else:
            whole = self._map(path)
            self.name = f"{socket.gethostname()}:{path}"
        header = _header_bytes(self.num_slots)
        self.checksums = whole[64:64 + 8 * self.num_slots].view(torch.int64)
        self.data = whole[header:].view(self.num_slots, self.slot_bytes)
        self._words = self.slot_bytes % 8 == 0  # (summed as int64 words, else as bytes)
        self.views = self._layer_views(self.data)
        self.server: TierServer | None = None  # (serve(): its slots to other hosts' workers)
        self.disk: HostKVTier | None = None
        if disk_size is not None:
            try:
                os.makedirs(disk_folder, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"--kv-offloading-disk-path {disk_folder}: {exc.strerror}") from None
            own = path is None
            disk_path = os.path.join(disk_folder, (f"llmbus-kv-{os.getuid()}-pid{os.getpid()}" if own
                                                   else os.path.basename(path)) + "-disk")
            self.disk = HostKVTier(caches, disk_size, disk_path, flag="--kv-offloading-disk-size")
            if own:
                os.unlink(disk_path)

    def _layer_views(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's part of every slot of `data` ([slots, slot_bytes]), shaped as that
        layer's block is."""
        views, offset = [], 0
        for cache, nbytes in zip(self.layers, self.layer_bytes):
            views.append(data[:, offset:offset + nbytes].view(cache.dtype).unflatten(1, cache.shape[1:]))
            offset += nbytes
        return views

    def serve(self, secret: bytes, host: str = "0.0.0.0", advertise: str | None = None, port: int = 0) -> str:
        """Serve this tier's slots to other hosts (kv_transfer.py); its address. A
        tensor-parallel worker's rank 0 serves every rank's file (on this host, named after
        its own: parallel/ranks.py), each rank of a loading worker asking for its own."""
        group = current_group()
        self.server = TierServer(self.data.numpy(), self.checksums.numpy(), secret, host, port, advertise,
                                 ranks=1 if group is None else group.world_size,
                                 peer=lambda rank: map_tier_file(f"{self.path}-tp{rank}"))
        return self.server.address

    def _map(self, path: str) -> torch.Tensor:
        size = _header_bytes(self.num_slots) + self.num_slots * self.slot_bytes
        header = _MAGIC + np.array([self.slot_bytes, self.num_slots, *self.order], dtype=np.int64).tobytes()
        assert len(header) <= 64, "the layout overruns the checksums"  # (a cache of more than 5 dims)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            existing = os.pread(fd, len(header), 0)
            if existing and existing.strip(b"\0") and existing != header:
                raise ValueError(f"the KV tier {path} holds another layout (another model, dtype or "
                                 "--kv-offloading-size on the same deployment)")
            if os.fstat(fd).st_size < size:
                # Its memory taken now: a tmpfs file merely truncated past what /dev/shm holds
                # would kill the worker with SIGBUS at the first store that reaches it.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise ValueError(f"{self.flag}: {path} cannot hold {size / (1 << 30):.2f} GiB "
                                     f"({exc.strerror}): lower it, or give its file system more room") from None
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    def _checksum(self, slot: int, data: torch.Tensor | None = None) -> int:
        row = (self.data if data is None else data)[slot]
        return int((row.view(torch.int64) if self._words else row.to(torch.int64)).sum())

    @property
    def num_disk_slots(self) -> int:
        return 0 if self.disk is None else self.disk.num_slots

    def load(self, orders: dict[int, int]) -> list[int]:
        """Slot -> block copies (`orders`: block id -> slot), before a forward reads them;
        the blocks whose slot failed its checksum (not to be used)."""
        if not orders:
            return []
        if self.disk is not None and max(orders.values()) >= self.num_slots:  # (some on disk)
            host = {block: slot for block, slot in orders.items() if slot < self.num_slots}
            return self.load(host) + self.disk.load({block: slot - self.num_slots for block, slot in orders.items()
                                                     if slot >= self.num_slots})
        bad = [block for block, slot in orders.items() if self._checksum(slot) != int(self.checksums[slot])]
        self._copy_in(orders, self.views)
        return bad

    def load_remote(self, load) -> list[int]:
        """Another host's slots (a RemoteKVLoad: its server, token and block -> slot orders)
        into these blocks, checked as local ones are; the blocks not to use: those that
        failed their checksum, or every one where the transfer did not complete."""
        staging = torch.empty(len(load.orders), self.slot_bytes, dtype=torch.uint8)
        try:
            group = current_group()
            sums = fetch_slots(load.address, load.token, load.expires, list(load.orders.values()), staging.numpy(),
                               self.slot_bytes, rank=0 if group is None else group.rank)
        except OSError as exc:
            log.warning("KV transfer from %s failed (%s): %d block(s) computed again", load.address, exc,
                        len(load.orders))
            return list(load.orders)
        bad = [block for i, block in enumerate(load.orders) if self._checksum(i, staging) != int(sums[i])]
        self._copy_in({block: i for i, block in enumerate(load.orders)}, self._layer_views(staging))
        return bad

    def _copy_in(self, orders: dict[int, int], views: list[torch.Tensor]) -> None:
        """Block id -> row of `views` (each layer's part of the source's rows) copies."""
        runs = _runs(orders)
        blocks, slots = self._indices(orders) if runs is None else (None, None)  # (index copies only)
        for cache, view in zip(self.layers, views):
            if runs is not None:  # one copy a run of consecutive blocks into consecutive slots
                for block, slot, n in runs:
                    cache[block:block + n].copy_(view[slot:slot + n])
            else:  # (index_select then index_copy_: a third faster than indexing both sides)
                cache.index_copy_(0, blocks.to(cache.device), view.index_select(0, slots).to(cache.device))

    def store(self, orders: dict[int, int], moves: dict[int, int] | None = None) -> None:
        """Block -> slot copies (`orders`: block id -> slot), after the forward wrote them;
        first, the blocks those slots held to the disk tier (`moves`: host slot -> its slot)."""
        for slot, dest in (moves or {}).items():
            self.disk.data[dest - self.num_slots].copy_(self.data[slot])
            self.disk.checksums[dest - self.num_slots] = self.checksums[slot]
        if not orders:
            return
        runs = _runs(orders)
        blocks, slots = self._indices(orders) if runs is None else (None, None)
        for cache, view in zip(self.layers, self.views):
            if runs is not None:
                for block, slot, n in runs:
                    view[slot:slot + n].copy_(cache[block:block + n])
            else:
                view.index_copy_(0, slots, cache.index_select(0, blocks.to(cache.device)).cpu())
        for slot in orders.values():
            self.checksums[slot] = self._checksum(slot)

    @staticmethod
    def _indices(orders: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(list(orders), dtype=torch.long), torch.tensor(list(orders.values()), dtype=torch.long)


def map_tier_file(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Another process's tier file on this host, read-only: (its slots [slots, slot_bytes]
    uint8, their checksums), by the layout its header gives."""
    with open(path, "rb") as f:
        header = f.read(len(_MAGIC) + 16)
    if header[:len(_MAGIC)] != _MAGIC:
        raise ValueError(f"{path} is not a KV tier of this version")
    slot_bytes, num_slots = np.frombuffer(header[len(_MAGIC):], dtype=np.int64).tolist()
    whole = np.memmap(path, dtype=np.uint8, mode="r", shape=(_header_bytes(num_slots) + num_slots * slot_bytes,))
    return (whole[_header_bytes(num_slots):].reshape(num_slots, slot_bytes),
            whole[64:64 + 8 * num_slots].view(np.int64))


def host_kv_tier(caches: list, cache_config, recurrent: bool, architecture: str,
                 kv_role: str = "kv_both") -> HostKVTier | None:
    """A worker's host KV tier (--kv-offloading-size), or None: not asked for, a hybrid model
    (`recurrent`: its state is no block's), or a tier file of another layout (said in the log).
    A prefill or decode worker (`kv_role`) hands requests over through it: none is an error."""
    tier = None
    if cache_config.kv_offloading_size is not None and recurrent:
        log.warning("--kv-offloading-size: off for %s, whose recurrent state the tier does not hold", architecture)
    elif cache_config.kv_offloading_size is not None:
        try:
            tier = HostKVTier(caches, cache_config.kv_offloading_size, cache_config.kv_offloading_path,
                              cache_config.kv_offloading_disk_size, cache_config.kv_offloading_disk_path)
        except ValueError as exc:
            log.warning("serving without the host KV tier: %s", exc)
    if kv_role != "kv_both" and tier is None:
        raise ValueError(f"a {kv_role} worker hands requests over through the host KV tier, which "
                         + (f"does not hold {architecture}'s recurrent state: disaggregated serving is not "
                            "supported for it" if recurrent else
                            "--kv-offloading-size gives (none, or a tier file of another layout)"))
    return tier


def load_for_step(tier: HostKVTier, so, drop) -> tuple[list[int], list[str]]:
    """A step's loads from the tier (so.kv_loads), before anything reads them: the blocks
    that failed their checksum, and the step's new requests that read one of them, each
    dropped from the step (`drop(request id)`): the scheduler computes them again."""
    bad = tier.load(so.kv_loads)
    for remote in so.kv_remote_loads:
        bad += tier.load_remote(remote)
    if not bad:
        return [], []
    bad_set = set(bad)
    failed = [new.req_id for new in so.scheduled_new_reqs if bad_set.intersection(new.block_ids)]
    for req_id in failed:
        drop(req_id)
    log.warning("host KV tier: %d block(s) failed their checksum; %d request(s) computed again", len(bad),
                len(failed))
    return bad, failed
