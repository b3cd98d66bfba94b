"""Which blocks each request holds: prefix lookup, allocation, freeing.

The scheduler asks in tokens; this turns tokens into blocks over one `BlockPool`.
"""

from __future__ import annotations

from services.scheduler.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from shared.block_hashes import hash_root, image_keys, iter_block_hashes
from services.scheduler.core.kv_tier_index import KVTierIndex
from shared.kv_transfer_tokens import sign
from shared.messages import RemoteKVLoad, SchedulerOutput
from services.scheduler.core.request import Request
from shared.lora_request import LoRARequest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 long_rope_threshold: int | None = None) -> None:
        self.block_size = block_size
        # longrope (Phi-3): a sequence past the threshold is rotated with the long factors from
        # its first token on, so its blocks hold other keys than the same tokens' in a shorter
        # one: its hash chain starts from another root (Scheduler restarts a request that
        # crosses, with its hashes cleared).
        self.long_rope_threshold = long_rope_threshold
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are registered already: each step registers
        # only the blocks that became full in it, not the whole context again (that walk was
        # 2.5 ms of a batch-128 decode step at 512 tokens of context; the GPU's whole step is
        # about 1.5 ms).
        self.num_cached_blocks: dict[str, int] = {}
        # How many computed tokens a request's blocks hold with no block to add and none
        # newly full to register: allocate_slots would change nothing below it, so the
        # scheduler does not call it for a decode there (most of a step's requests). Set as
        # allocate_slots returns; the blocks and registered count only grow until `free`, so
        # a bound from an earlier step is never above the true one.
        self.quiet_until: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up, cumulative
        self.prefix_cache_hits = 0  # tokens found, cumulative
        # The host's KV tier (--kv-offloading-size; kv_tier_index.py), shared with the other
        # cores of its workers, None without one; and this step's orders for it: block id ->
        # slot to load before its forward, and to store after it (with the request that
        # writes the block), then the same by step until each lands.
        self.tier: KVTierIndex | None = None
        self._loads: dict[int, int] = {}
        self._stores: dict[int, int] = {}
        self._store_writers: dict[int, str] = {}  # slot -> request id
        self._moves: dict[int, int] = {}  # host slot -> disk slot: the block it held, moved before its store
        self._tier_orders: dict[int, tuple[list[int], dict[int, str], list[int]]] = {}
        # Other hosts' tiers (kv_transfer.py: their slots loaded over TCP into this worker's
        # tier's layout), where the fleet gives them: a callable listing (index, server
        # address), and the deployment's secret each transfer's token is signed with; this
        # step's remote loads by server (block id -> slot there), then the same by step.
        self.remote_tiers = None
        self.transfer_secret: bytes | None = None
        self._remote: dict[str, dict[int, int]] = {}
        self._remote_indexes: dict[str, KVTierIndex] = {}
        self._remote_orders: dict[int, dict[str, list[int]]] = {}
        self.external_prefix_cache_queries = 0  # vLLM's (its KV connector's): tokens looked up in the tier
        self.external_prefix_cache_hits = 0  # and found there

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def runs_long(self, request: Request) -> bool:
        """Whether a request (re)starting now is past the longrope threshold: long factors."""
        return self.long_rope_threshold is not None and request.num_tokens > self.long_rope_threshold

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes to every block its tokens fill."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        root = hash_root(self.runs_long(request), request.lora_request, request.cache_salt)
        images = request.mm_features
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else root
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs],
                                            image_keys(images, i * bs, (i + 1) * bs) if images else b""))

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that prefixes the request.

        It stops one token short of the whole request: the last token is always computed,
        because its logits are what the next token is sampled from.
        """
        if not self._may_hit(request):
            return []
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _may_hit(self, request: Request) -> bool:
        # (a prompt's logprobs come from computing every prompt token, as vLLM's)
        return self.enable_caching and (request.sampling_params.prompt_logprobs is None or request.num_output_tokens > 0)

    def tier_hits(self, request: Request, num_pool_hits: int) -> tuple[list[int], int, str | None]:
        """The tier's slots of the request's blocks after its pool hits (a prefix run, one
        token short of the whole request as get_computed_blocks'), to load in its step, the
        tokens they hold (with a handed-over request's partial last block, `kv_tail`, where
        every full block before it was found), and where from: None for this host's tier,
        else the server of another host's that holds more of them."""
        if self.tier is None or not self._may_hit(request):
            return [], 0, None
        if self.remote_tiers is None or self.transfer_secret is None:
            return (*self._hits_in(self.tier, request, num_pool_hits), None)
        # (each tier looked at without touching its LRU order; only the one loaded from is)
        best, chosen = (*self._hits_in(self.tier, request, num_pool_hits, touch=False), None), self.tier
        for index, address in self.remote_tiers():
            slots, tokens = self._hits_in(index, request, num_pool_hits, remote=True, touch=False)
            if tokens > best[1]:
                best, chosen = (slots, tokens, address), index
                self._remote_indexes[address] = index
        self._hits_in(chosen, request, num_pool_hits, remote=best[2] is not None)
        return best

    def _hits_in(self, tier: KVTierIndex, request: Request, num_pool_hits: int,
                 remote: bool = False, touch: bool = True) -> tuple[list[int], int]:
        num_full = (request.num_tokens - 1) // self.block_size
        slots = tier.find(request.block_hashes, num_pool_hits, num_full, remote, touch)
        tokens = len(slots) * self.block_size
        if request.kv_tail is not None:  # (where the blocks found end just where the tail begins)
            key, end = request.kv_tail
            tail = tier.find([key], 0, 1, remote, touch) \
                if num_pool_hits + len(slots) == end // self.block_size else []
            if tail:
                slots.append(tail[0])
                tokens += end % self.block_size
        return slots, tokens

    def store_tail(self, request: Request, num_tokens: int) -> None:
        """A request to go on elsewhere: the partial block its first `num_tokens` tokens end
        in goes to the tier with the step this is (that computes them, or none), with any of
        its full blocks not stored yet."""
        request.kv_tail = None
        if self.tier is None:
            return
        if self.enable_caching:  # (full blocks a step in flight filled are registered, and stored, only now)
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)
        if not num_tokens % self.block_size:
            return
        key = b"tail:" + request.request_id.encode()
        slot = self.tier.reserve(key, self._moves)
        if slot is not None:
            block = self.req_to_blocks[request.request_id][num_tokens // self.block_size]
            self._stores[block.block_id] = slot
            self._store_writers[slot] = request.request_id
            request.kv_tail = key, num_tokens

    def num_cached_prefix_blocks(self, token_ids: list[int], lora: LoRARequest | None = None,
                                 cache_salt: str | None = None, mm_features=()) -> int:
        """How many leading full blocks of these tokens (and images) are cached here (for placement)."""
        if not self.enable_caching:
            return 0
        found = 0  # (one token short, as get_computed_blocks: the last is always computed)
        for block_hash in iter_block_hashes(token_ids[:-1], self.block_size, cache_salt, lora, mm_features):
            if self.block_pool.get_cached_block(block_hash) is None:
                break
            found += 1
        return found

    def record_prefix_lookup(self, num_queried: int, num_hit: int, num_loaded: int = 0) -> None:
        """`num_hit` tokens found of `num_queried`, `num_loaded` of them from the tier."""
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit
        if self.tier is not None:
            self.external_prefix_cache_queries += num_queried
            self.external_prefix_cache_hits += num_loaded

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        loads: list[int] = (),
        num_loaded: int = 0,
        source: str | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and
        `loads`: tier slots of the blocks after its cached ones, loaded into new blocks,
        `num_loaded` tokens; from another host's tier where `source` names its server).

        Returns the newly allocated blocks (possibly none), or None when the pool cannot
        hold them, in which case nothing has changed.
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is not None and not new_computed_blocks and not loads:
            # A running request (most calls: a decode's one token): often no new block, and
            # no block newly full; this path costs a few attribute reads a request a step.
            num_after = request.num_computed_tokens + num_new_tokens
            if num_after <= len(req_blocks) * self.block_size:
                if self.enable_caching and min(num_after, len(request.all_token_ids)) // self.block_size > \
                        self.num_cached_blocks.get(request.request_id, 0):
                    self._cache_full_blocks(request, req_blocks, num_after)
                self._note_quiet(request.request_id, req_blocks)
                return []
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_loaded
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # A prefix hit on a block with no other user takes it off the free queue too.
        num_reused_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_reused_free:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if loads:
            request.kv_tail = None  # (loaded now, if it was found)
            (self.tier if source is None else self._remote_indexes[source]).pin(loads)
            orders = self._loads if source is None else self._remote.setdefault(source, {})
            orders.update((block.block_id, slot) for block, slot in zip(new_blocks, loads))
        if self.enable_caching:
            # Register blocks that will be full once this step is computed. Another request
            # may hit them in this same step: the worker writes every token's K/V of a layer
            # before any attention of that layer reads the cache, so that is safe.
            self._cache_full_blocks(request, req_blocks, num_computed + num_new_tokens)
        self._note_quiet(request.request_id, req_blocks)
        return new_blocks

    def _note_quiet(self, request_id: str, req_blocks: list[KVCacheBlock]) -> None:
        room = len(req_blocks) * self.block_size
        if self.enable_caching:  # (below the end of the block after the registered ones, none fills)
            room = min(room, (self.num_cached_blocks.get(request_id, 0) + 1) * self.block_size - 1)
        self.quiet_until[request_id] = room

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        self.update_block_hashes(request)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        pool, hashes, bs = self.block_pool, request.block_hashes, self.block_size
        lora = request.lora_request.lora_int_id if request.lora_request is not None else None
        for i in range(num_cached, num_full):
            if pool.events is None:
                pool.cache_full_block(req_blocks[i], hashes[i])
            else:  # (what a KV event says of the block: its parent, its tokens, its adapter)
                pool.cache_full_block(req_blocks[i], hashes[i], hashes[i - 1] if i else None,
                                      request.all_token_ids[i * bs:(i + 1) * bs], lora)
            if self.tier is not None and req_blocks[i].block_hash == hashes[i]:  # (the pool's copy: this one)
                self._store(request, req_blocks[i])
        self.num_cached_blocks[request.request_id] = num_full

    def _store(self, request: Request, block: KVCacheBlock) -> None:
        if block.block_id in self._loads:
            return  # (the tier's own)
        slot = self.tier.reserve(block.block_hash, self._moves)
        if slot is not None:
            self._stores[block.block_id] = slot
            self._store_writers[slot] = request.request_id

    def take_tier_orders(self, output: SchedulerOutput) -> None:
        """This step's tier orders into `output` (loads, stores, blocks moved to the disk
        tier, loads from other hosts' tiers, each with its token), kept until it lands."""
        step_id = output.step_id
        if self._remote:
            self._remote_orders[step_id] = {address: list(slots.values()) for address, slots in self._remote.items()}
            output.kv_remote_loads = [RemoteKVLoad(address, *sign(self.transfer_secret, address,
                                                                  list(orders.values())), orders)
                                      for address, orders in self._remote.items()]
            self._remote = {}
        if not self._loads and not self._stores:
            return
        output.kv_loads, output.kv_stores, output.kv_tier_moves = self._loads, self._stores, self._moves
        self._tier_orders[step_id] = (list(self._loads.values()), self._store_writers, list(self._moves.values()))
        self._loads, self._stores, self._store_writers, self._moves = {}, {}, {}, {}

    def tier_orders_landed(self, step_id: int, written: set[str] | None) -> None:
        """Step `step_id` came back: its loads are done; its stores of blocks written by the
        requests in `written` (None: none, the step failed) become findable, the rest free."""
        for address, slots in self._remote_orders.pop(step_id, {}).items():
            self._remote_indexes[address].unpin(slots)
        orders = self._tier_orders.pop(step_id, None)
        if orders is not None:
            self.tier.unpin(orders[0])
            for slot, req_id in orders[1].items():
                self.tier.landed(slot, written is not None and req_id in written)
            for slot in orders[2]:  # (a block moved to the disk tier: whoever wrote it, it was valid)
                self.tier.landed(slot, written is not None)

    def bad_loads(self, step: SchedulerOutput, bad_blocks: list[int]) -> list[str]:
        """Blocks a step loaded that failed their checksum (or, from another host, did not
        arrive): their slots discarded, the blocks forgotten by the pool; the ids of the
        requests holding them (those that read them), to compute again."""
        bad = set(bad_blocks)
        source = {block: (self.tier, slot) for block, slot in step.kv_loads.items()}
        for load in step.kv_remote_loads:
            source.update((block, (self._remote_indexes[load.address], slot)) for block, slot in load.orders.items())
        for block_id in bad:
            tier, slot = source[block_id]
            tier.discard(slot)
            self.block_pool.uncache(self.block_pool.blocks[block_id])
        return [rid for rid, blocks in self.req_to_blocks.items() if any(b.block_id in bad for b in blocks)]

    def drop_tier_orders(self) -> None:
        """Its worker is gone: no step in flight will land."""
        for step_id in list(self._tier_orders):
            self.tier_orders_landed(step_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request, forget_cached: bool = False) -> None:
        """Give the request's blocks back. `forget_cached` after a failed step: the K/V of
        blocks registered for that step may never have been written, so no later request
        may hit them (blocks shared with others were computed earlier and stay)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.quiet_until.pop(request.request_id, None)
        if forget_cached:
            for block in blocks:
                if block.ref_cnt == 1:
                    self.block_pool.uncache(block)
        self.block_pool.free_blocks(reversed(blocks))
