"""The host's KV tier as a worker sees it (--kv-offloading-size; vLLM's native CPU offloading):
slots of one KV block each, every attention layer's keys and values of the block in one
contiguous run, in a shared-memory file every worker of the host maps. The scheduler keeps
the index (services/scheduler/core/kv_tier_index.py) and orders the copies in each step:
loads into the worker's blocks before the forward, stores out of them after it. Copies are
of bytes, so a block loaded is bit-identical to the block stored.

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

log = logging.getLogger("llmbus.worker")

_HEADER = 4096  # the layout, then the slots (page aligned)
_MAGIC = b"llmbus-kv-tier-1"


class HostKVTier:
    def __init__(self, caches: list, size_bytes: int, path: str | None) -> None:
        """`caches`: the worker's (an attention layer's [K|V, num_blocks, ...] tensor; the
        others' entries, state or None, have no blocks); `path` None: a tier of this process
        alone (the offline LLM's)."""
        # (a latent cache's keys are its values, one memory expanded to [2, ...]: copied once)
        self.layers = [c[:1] if c.shape[0] > 1 and c.stride(0) == 0 else c for c in caches if isinstance(c, torch.Tensor)]
        self.layer_bytes = [c[:, 0].numel() * c.element_size() for c in self.layers]
        self.slot_bytes = sum(self.layer_bytes)
        self.num_slots = size_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"--kv-offloading-size ({size_bytes / (1 << 30):g} GiB) holds no KV block of this model "
                             f"({self.slot_bytes / (1 << 20):.1f} MiB a block)")
        self.path = path
        if path is None:
            data = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8)
            self.name = f"{socket.gethostname()}:pid{os.getpid()}"
        else:
            data = self._map(path)
            self.name = f"{socket.gethostname()}:{path}"
        data = data.view(self.num_slots, self.slot_bytes)
        # Each layer's part of every slot, shaped as that layer's block is
        self.views, offset = [], 0
        for cache, nbytes in zip(self.layers, self.layer_bytes):
            block_shape = (cache.shape[0], *cache.shape[2:])
            self.views.append(data[:, offset:offset + nbytes].view(cache.dtype).unflatten(1, block_shape))
            offset += nbytes

    def _map(self, path: str) -> torch.Tensor:
        size = _HEADER + self.num_slots * self.slot_bytes
        header = _MAGIC + np.array([self.slot_bytes, self.num_slots], dtype=np.int64).tobytes()
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
                    raise ValueError(f"--kv-offloading-size: {path} cannot hold {size / (1 << 30):.2f} GiB "
                                     f"({exc.strerror}): lower it, or give /dev/shm more room") from None
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)
        mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return mapped[_HEADER:]

    def load(self, orders: dict[int, int]) -> None:
        """Slot -> block copies (`orders`: block id -> slot), before a forward reads them."""
        if not orders:
            return
        blocks, slots = self._indices(orders)
        for cache, view in zip(self.layers, self.views):
            cache[:, blocks.to(cache.device)] = view[slots].transpose(0, 1).to(cache.device)

    def store(self, orders: dict[int, int]) -> None:
        """Block -> slot copies (`orders`: block id -> slot), after the forward wrote them."""
        if not orders:
            return
        blocks, slots = self._indices(orders)
        for cache, view in zip(self.layers, self.views):
            view[slots] = cache[:, blocks.to(cache.device)].transpose(0, 1).cpu()

    @staticmethod
    def _indices(orders: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(list(orders), dtype=torch.long), torch.tensor(list(orders.values()), dtype=torch.long)


def host_kv_tier(caches: list, cache_config, recurrent: bool, architecture: str) -> HostKVTier | None:
    """A worker's host KV tier (--kv-offloading-size), or None: not asked for, a hybrid model
    (`recurrent`: its state is no block's), or a tier file of another layout (said in the log)."""
    if cache_config.kv_offloading_size is None:
        return None
    if recurrent:
        log.warning("--kv-offloading-size: off for %s, whose recurrent state the tier does not hold", architecture)
        return None
    try:
        return HostKVTier(caches, cache_config.kv_offloading_size, cache_config.kv_offloading_path)
    except ValueError as exc:
        log.warning("serving without the host KV tier: %s", exc)
        return None
