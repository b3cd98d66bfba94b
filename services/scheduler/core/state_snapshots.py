"""Which of a hybrid worker's state snapshot slots holds the recurrent state after which
cached block: the prefix cache of models whose recurrent layers (Mamba2, Gated DeltaNet,
short convolutions) fold a request's whole past into one state.

KV blocks alone cannot restore such a request: its attention layers would find their
keys and values, its recurrent layers nothing. So a request's prefill stops at the last
block boundary before its last token, and where its KV cache hit ends if no state was
saved there (a prefix it shares with a request before it: a system prompt) (vLLM's
"align" mode: the scheduler ends a chunk there); the worker copies the request's state
into a snapshot slot after that step, and the slot is keyed by the hash of the block the
state ends at (the chain of hashes names every token before it, its LoRA adapter and
cache salt too). A later request whose cached prefix reaches that block starts after it,
its state copied back from the slot first; one whose cached blocks reach a save still in
flight waits for it (`on_its_way`).

A slot becomes findable only when the step that filled it has landed without an error
for its request: a save the worker never made must never be restored. Slots are reused
least recently used first; one with a save in flight is never taken.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, OrderedDict

from services.scheduler.core.block_pool import BlockHash
from services.scheduler.core.request import Request
from shared.config import SchedulerConfig

log = logging.getLogger(__name__)


class StateSnapshots:
    @classmethod
    def for_hybrid(cls, config: SchedulerConfig, recurrent_rows: int,
                   snapshot_rows: int) -> tuple[SchedulerConfig, StateSnapshots | None]:
        """A scheduler's config and snapshots for a model whose worker holds `recurrent_rows`
        requests' recurrent state (0: no recurrent layers, the config as it is) and
        `snapshot_rows` snapshots of it. A recurrent layer's state is a request's whole past
        folded into one row: a cached prefix restores it only from a snapshot of the state at
        the prefix's end; without snapshots every request computes from its first token. No
        more run at once than the worker has rows for."""
        if not recurrent_rows:
            return config, None
        caching = config.enable_prefix_caching and snapshot_rows > 0
        if config.enable_prefix_caching != caching or config.max_num_seqs > recurrent_rows:
            log.info("a hybrid model: prefix caching %s, max_num_seqs %d", "on" if caching else "off",
                     min(config.max_num_seqs, recurrent_rows))
        config = dataclasses.replace(config, enable_prefix_caching=caching,
                                     max_num_seqs=min(config.max_num_seqs, recurrent_rows))
        return config, cls(snapshot_rows) if caching else None

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # landed, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._in_flight: dict[int, BlockHash] = {}  # slot -> the block its save (not landed) ends at
        # The same, counted by block: `saving` runs for a waiting request's every cached block
        self._saving: Counter[BlockHash] = Counter()

    def longest_hit(self, block_hashes: list[BlockHash], num_blocks: int) -> tuple[int, int | None]:
        """Of a request's first `num_blocks` blocks (a KV cache hit), the most it can start
        after: (blocks, the slot holding the state there), or (0, None)."""
        for n in range(num_blocks, 0, -1):
            slot = self._slot_of.get(block_hashes[n - 1])
            if slot is not None:
                self._slot_of.move_to_end(block_hashes[n - 1])
                return n, slot
        return 0, None

    def has(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of or self.saving(block_hash)

    def saving(self, block_hash: BlockHash) -> bool:
        """Whether a save of the state after this block is in flight (not landed yet)."""
        return self._saving[block_hash] > 0

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for the state after `block_hash`'s block (a free one, else the least
        recently used landed one), or None if every slot has a save in flight. A slot
        restored from earlier in the same step is safe to take: the worker restores before
        the step's forward and saves after it."""
        if self._free:
            slot = self._free.pop()
        elif self._slot_of:
            _, slot = self._slot_of.popitem(last=False)
        else:
            return None
        self._in_flight[slot] = block_hash
        self._saving[block_hash] += 1
        return slot

    def landed(self, slot: int, ok: bool) -> None:
        """The step that saved into `slot` landed: findable if the worker made the save."""
        block_hash = self._in_flight.pop(slot, None)
        if block_hash is None:
            return
        self._saving[block_hash] -= 1
        if not self._saving[block_hash]:
            del self._saving[block_hash]
        if ok and block_hash not in self._slot_of:
            self._slot_of[block_hash] = slot
        else:
            self._free.append(slot)

    # ---- a request's saves and the ones it waits for --------------------------------

    def points_for(self, request: Request, num_hit: int, kv_hit: int, block_size: int) -> list[int]:
        """Where a hybrid request (re)starting after `num_hit` tokens saves its recurrent
        state, ascending: the last block boundary before its last token (as far as the same
        tokens again can hit: one is always computed), for the same prompt again or a
        conversation's next turn; and where its KV cache hit ends (`kv_hit`) if no state
        was saved there: blocks another request computed before, a prefix they share (a
        system prompt), so the requests after both find a state at its end. Boundaries
        saved already, or not past the hit, are left out. (Its block hashes must be up to
        date: KVCacheManager.update_block_hashes.)"""
        points = sorted({kv_hit, (request.num_tokens - 1) // block_size * block_size})
        return [p for p in points if p > num_hit and not self.has(request.block_hashes[p // block_size - 1])]

    def on_its_way(self, request: Request, num_hit: int, kv_hit: int, block_size: int) -> bool:
        """Whether a save in flight would let this hybrid request start past `num_hit`:
        at a block boundary of its KV cache hit (`kv_hit`) beyond it."""
        return any(self.saving(request.block_hashes[end // block_size - 1]) for end in range(kv_hit, num_hit, -block_size))

    def reserve_next(self, request: Request, saves: dict[str, int], block_size: int) -> None:
        """This step computes the request's tokens up to its next snapshot point: the
        worker saves its state there after the forward (findable once the step lands)."""
        slot = self.reserve(request.block_hashes[request.snapshot_points.pop(0) // block_size - 1])
        if slot is not None:  # (None: every slot has a save in flight; this one goes unsaved)
            saves[request.request_id] = slot
