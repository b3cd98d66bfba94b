"""Which slot of a host's KV tier holds which block (--kv-offloading-size): the scheduler's
index of the shared-memory file every worker of that host maps (services/worker/kv_tier.py).

The scheduler already names every block by its chained hash, so the tier needs no index of
its own on the workers: a step tells its worker which blocks to copy into which slots after
its forward (`kv_stores`: blocks that became full in it) and which slots to copy into which
of its blocks before it (`kv_loads`: a prefix the pool lost, or another worker computed).
Every worker core of a host shares one index, so worker B loads what worker A stored.

What makes a hit safe (the bug class of the peers' offloading: KV used before it was
written, or after its slot was reused):
- a slot becomes findable only when the step that stored it has landed without an error for
  the request that wrote the block;
- a slot a load is in flight from is pinned until that step lands: never reused before;
- a slot being stored is neither findable nor reusable until its step lands;
- the rest are reused least recently used first.

With a disk tier behind it (--kv-offloading-disk-path), the index numbers the disk file's
slots after the host's (`num_slots` host slots, then `num_disk_slots`): a block the host
tier gives up for a new one moves to the disk tier (its slot's bytes copied to a disk slot
by the worker storing the new block, before that store), and is findable there once that
step lands; the disk tier gives up its least recently used block in turn. A load reads
either file; a slot of either is pinned, stored and discarded alike.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

from services.scheduler.core.block_pool import BlockHash

log = logging.getLogger("llmbus.scheduler")


class KVTierIndex:
    def __init__(self, num_slots: int, num_disk_slots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"a KV tier needs a slot, got {num_slots}")
        self.num_slots, self.num_disk_slots = num_slots, num_disk_slots
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # landed, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._free_disk = list(range(num_slots + num_disk_slots - 1, num_slots - 1, -1))
        self._storing: dict[int, BlockHash] = {}  # slot -> the block its store (not landed) holds
        self._stored_hashes: set[BlockHash] = set()  # the same, by hash
        self._pins: Counter[int] = Counter()  # slot -> loads in flight from it
        self._discarded: set[int] = set()  # slots to free once no load is in flight from them

    def __len__(self) -> int:
        """Blocks findable now."""
        return len(self._slot_of)

    @property
    def num_busy_slots(self) -> int:
        """Slots a step in flight stores to or loads from."""
        return len(self._storing) + len(self._pins)

    def find(self, block_hashes: list[BlockHash], start: int, stop: int, host_only: bool = False,
             touch: bool = True) -> list[int]:
        """The slots of block_hashes[start:stop] that the tier holds, as one run from `start`
        (a prefix: the first block missing ends it; `host_only`: or on disk, which other
        hosts' transfers do not read). Each found block becomes the most recently used,
        unless this is only a look (`touch` false: a tier the caller may not load from)."""
        slots = []
        for block_hash in block_hashes[start:stop]:
            slot = self._slot_of.get(block_hash)
            if slot is None or host_only and slot >= self.num_slots:
                break
            if touch:
                self._slot_of.move_to_end(block_hash)
            slots.append(slot)
        return slots

    def pin(self, slots: list[int]) -> None:
        """Loads from these slots are in a step now."""
        self._pins.update(slots)

    def unpin(self, slots: list[int]) -> None:
        self._pins.subtract(slots)
        for slot in slots:
            if self._pins[slot] <= 0:
                del self._pins[slot]
                if slot in self._discarded:
                    self._discarded.discard(slot)
                    self._release(slot)

    def discard(self, slot: int) -> None:
        """A slot whose block failed its checksum where it was loaded: never found again, and
        free once no load is in flight from it."""
        victim = next((h for h, s in self._slot_of.items() if s == slot), None)
        if victim is None:
            return  # (discarded already, or reused)
        del self._slot_of[victim]
        if slot in self._pins:
            self._discarded.add(slot)
        else:
            self._release(slot)

    def reserve(self, block_hash: BlockHash, moves: dict[int, int] | None = None) -> int | None:
        """A host slot to store this block in, or None: the tier holds it or is storing it
        already, or every slot is busy with a step in flight. Where the slot held a block and
        a disk tier is behind, that block's move (host slot -> disk slot) goes into `moves`,
        to be copied before the store."""
        if block_hash in self._slot_of or block_hash in self._stored_hashes:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._victim(disk=False)
            if victim is None:
                return None
            del self._slot_of[victim[0]]
            slot = victim[1]
            if self.num_disk_slots and moves is not None:
                dest = self._disk_slot()
                if dest is not None:
                    self._storing[dest] = victim[0]
                    self._stored_hashes.add(victim[0])
                    moves[slot] = dest
        self._storing[slot] = block_hash
        self._stored_hashes.add(block_hash)
        return slot

    def _victim(self, disk: bool) -> tuple[BlockHash, int] | None:
        """The least recently used landed block of the host's slots or the disk's that no
        load in flight reads."""
        return next(((h, s) for h, s in self._slot_of.items()
                     if (s >= self.num_slots) == disk and s not in self._pins), None)

    def _disk_slot(self) -> int | None:
        if self._free_disk:
            return self._free_disk.pop()
        victim = self._victim(disk=True)
        if victim is None:
            return None
        del self._slot_of[victim[0]]
        return victim[1]

    def _release(self, slot: int) -> None:
        (self._free if slot < self.num_slots else self._free_disk).append(slot)

    def landed(self, slot: int, ok: bool) -> None:
        """The step storing to `slot` (or moving a block to it) came back: its block is
        findable (`ok`), or the slot is free again (the step failed: what it wrote is not
        trusted)."""
        block_hash = self._storing.pop(slot)
        self._stored_hashes.discard(block_hash)
        if ok:
            self._slot_of[block_hash] = slot
        else:
            self._release(slot)


def tier_of(worker_id: str, name: str, num_slots: int, tiers: dict[str, KVTierIndex] | None,
            num_disk_slots: int = 0) -> KVTierIndex | None:
    """The index of the tier `name` a worker maps (empty: none), shared through `tiers` with
    the other workers that map it."""
    if not name:
        return None
    tiers = {} if tiers is None else tiers
    tier = tiers.setdefault(name, KVTierIndex(num_slots, num_disk_slots))
    if (tier.num_slots, tier.num_disk_slots) != (num_slots, num_disk_slots):  # (the file checks its layout)
        log.warning("worker %s maps the KV tier %s with %d+%d slots, not %d+%d: without it", worker_id, name,
                    num_slots, num_disk_slots, tier.num_slots, tier.num_disk_slots)
        return None
    return tier
