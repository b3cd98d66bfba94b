"""BlockPool and KVCacheManager: block ids, free queue order, reference counts, prefix cache."""

from __future__ import annotations

import pytest

from services.scheduler.core.block_pool import BlockPool, hash_block_tokens
from services.scheduler.core.kv_cache_manager import KVCacheManager
from services.scheduler.core.request import Request
from shared.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(),
        eos_token_id=None,
        max_tokens=16,
    )


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def allocate_prompt(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a waiting request: prefix lookup, then allocate the rest."""
    hits = manager.get_computed_blocks(request)
    num_hit = len(hits) * manager.block_size
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    return ids(new)


def free_queue_order(pool: BlockPool) -> list[int]:
    """Drain the free queue to see its order (front = evicted first)."""
    return ids(pool.get_new_blocks(pool.num_free_blocks))


# ---- BlockPool: ids, free queue, reference counts ------------------------------------------


def test_new_blocks_are_handed_out_in_id_order():
    pool = BlockPool(8)
    assert ids(pool.get_new_blocks(3)) == [0, 1, 2]
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert pool.num_free_blocks == 3
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_asking_for_more_blocks_than_are_free_raises_and_takes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert ids(pool.get_new_blocks(1)) == [2]


def test_a_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks must be at least 1"):
        BlockPool(0)


def test_freed_blocks_join_the_free_queue_in_the_order_given():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.num_free_blocks == 4
    assert free_queue_order(pool) == [2, 0, 3, 1]


def test_freed_blocks_go_behind_the_never_used_ones():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert free_queue_order(pool) == [2, 3, 4, 0, 1]


def test_a_block_with_another_reference_does_not_join_the_free_queue():
    pool = BlockPool(2)
    block, _ = pool.get_new_blocks(2)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 0
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 1


def test_touching_a_free_cached_block_takes_it_off_the_free_queue():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_block(blocks[1], b"h1")
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(b"h1")
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free_blocks == 2
    # The touched block is not handed out again, and keeps its hash.
    assert ids(pool.get_new_blocks(2)) == [0, 2]
    assert pool.get_cached_block(b"h1") is hit
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_freeing_a_block_more_often_than_taken_raises_and_never_goes_negative():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError, match="block 0 freed more often than taken"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.num_free_blocks == 2
    # It is in the free queue once, not twice.
    assert free_queue_order(pool) == [1, 0]


def test_usage_is_the_fraction_of_blocks_in_use():
    pool = BlockPool(4)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.usage == 0.75
    pool.free_blocks(blocks)
    assert pool.usage == 0.0


def test_reallocating_a_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], b"h0")
    pool.free_blocks(blocks)
    assert pool.get_cached_block(b"h0") is blocks[0]
    (again,) = pool.get_new_blocks(1)
    assert again is blocks[0]
    assert again.block_hash is None
    assert pool.get_cached_block(b"h0") is None


def test_the_first_block_registered_under_a_hash_wins():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_block(first, b"same")
    pool.cache_full_block(second, b"same")
    assert pool.get_cached_block(b"same") is first
    assert second.block_hash is None


def test_a_pool_without_caching_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h")
    assert pool.get_cached_block(b"h") is None
    assert block.block_hash is None


def test_reset_prefix_cache_only_when_no_block_is_in_use():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], b"h0")
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h0") is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h0") is None
    assert blocks[0].block_hash is None


# ---- hashing ------------------------------------------------------------------------------


def test_block_hashes_are_chained_on_the_parent():
    tokens = [1, 2, 3, 4]
    root = hash_block_tokens(None, tokens)
    assert root == hash_block_tokens(None, [1, 2, 3, 4])
    assert len(root) == 16
    parent_a = hash_block_tokens(None, [9, 9, 9, 9])
    parent_b = hash_block_tokens(None, [8, 8, 8, 8])
    assert hash_block_tokens(parent_a, tokens) != hash_block_tokens(parent_b, tokens)
    assert hash_block_tokens(parent_a, tokens) != root
    assert hash_block_tokens(None, [1, 2, 3, 5]) != root


def test_request_block_hashes_cover_full_blocks_only():
    manager = KVCacheManager(8, BLOCK_SIZE)
    request = make_request("r", list(range(10)))
    manager.update_block_hashes(request)
    first = hash_block_tokens(None, [0, 1, 2, 3])
    assert request.block_hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]
    request.append_output_token(10)
    request.append_output_token(11)
    manager.update_block_hashes(request)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [8, 9, 10, 11])


# ---- KVCacheManager: allocation and freeing ----------------------------------------------


def test_allocate_slots_rounds_tokens_up_to_whole_blocks():
    manager = KVCacheManager(8, BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    assert ids(manager.allocate_slots(request, 10)) == [0, 1, 2]
    request.num_computed_tokens = 10
    # Two more tokens still fit in block 2; the third needs a new block.
    assert ids(manager.allocate_slots(request, 2)) == []
    request.num_computed_tokens = 12
    assert ids(manager.allocate_slots(request, 1)) == [3]
    assert manager.get_block_ids("a") == [0, 1, 2, 3]


def test_freed_blocks_are_evicted_tail_first():
    manager = KVCacheManager(6, BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(50, 58)))
    assert allocate_prompt(manager, a) == [0, 1, 2]
    assert allocate_prompt(manager, b) == [3, 4]
    manager.free(a)
    assert manager.get_block_ids("a") == []
    # The never-used block 5 first, then a's blocks from its tail.
    assert free_queue_order(manager.block_pool) == [5, 2, 1, 0]


def test_cached_blocks_are_evicted_least_recently_freed_first():
    manager = KVCacheManager(6, BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(50, 58)))
    allocate_prompt(manager, a)
    allocate_prompt(manager, b)
    manager.free(a)
    manager.free(b)
    assert manager.block_pool.num_free_blocks == 6
    assert free_queue_order(manager.block_pool) == [5, 2, 1, 0, 4, 3]


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_too_small():
    manager = KVCacheManager(4, BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    allocate_prompt(manager, a)
    b = make_request("b", list(range(50, 58)))
    assert manager.allocate_slots(b, 8) is None
    assert "b" not in manager.req_to_blocks
    assert manager.block_pool.num_free_blocks == 1
    assert [blk.ref_cnt for blk in manager.block_pool.blocks] == [1, 1, 1, 0]
    # A running request that cannot grow keeps what it had.
    assert manager.allocate_slots(a, 7) is None
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.block_pool.num_free_blocks == 1


def test_prefix_hits_on_free_blocks_count_against_the_free_space():
    manager = KVCacheManager(3, BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    allocate_prompt(manager, a)
    manager.free(a)
    # Shares a's two full blocks, then needs two blocks of its own: 2 hits + 2 new > 3.
    b = make_request("b", list(range(8)) + [70, 71, 72, 73, 74])
    hits = manager.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    assert manager.allocate_slots(b, 5, hits) is None
    pool = manager.block_pool
    assert pool.num_free_blocks == 3
    assert [blk.ref_cnt for blk in pool.blocks] == [0, 0, 0]
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[0]
    assert pool.get_cached_block(a.block_hashes[1]) is pool.blocks[1]
    assert "b" not in manager.req_to_blocks


# ---- prefix caching -------------------------------------------------------------------------

PREFIX = [10, 11, 12, 13, 14, 15, 16, 17]  # two full blocks


def test_a_shared_prefix_is_served_from_the_first_requests_blocks():
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", PREFIX + [90, 91, 92])
    assert manager.get_computed_blocks(a) == []
    assert allocate_prompt(manager, a) == [0, 1, 2]
    b = make_request("b", PREFIX + [70, 71, 72])
    hits = manager.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    assert ids(manager.allocate_slots(b, 3, hits)) == [3]
    assert manager.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in manager.block_pool.blocks[:4]] == [2, 2, 1, 1]
    # Freeing a leaves the shared blocks with b.
    manager.free(a)
    assert [blk.ref_cnt for blk in manager.block_pool.blocks[:4]] == [1, 1, 0, 1]


def test_only_full_blocks_are_shared():
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", PREFIX + [90, 91, 92])
    allocate_prompt(manager, a)
    # Agrees with a on six tokens: the first block, and half of the second.
    c = make_request("c", PREFIX[:6] + [60, 61, 62, 63, 64])
    assert ids(manager.get_computed_blocks(c)) == [0]
    # a's partly filled third block was never registered.
    d = make_request("d", PREFIX + [90, 91, 92, 93, 94])
    assert ids(manager.get_computed_blocks(d)) == [0, 1]


def test_the_last_token_of_a_fully_cached_prompt_is_not_a_hit():
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", PREFIX + [90, 91, 92])
    allocate_prompt(manager, a)
    # Eight tokens, both blocks cached: (8 - 1) // 4 = 1 block may hit.
    same = make_request("same", list(PREFIX))
    assert ids(manager.get_computed_blocks(same)) == [0]
    # One token more and both blocks may hit: (9 - 1) // 4 = 2.
    longer = make_request("longer", PREFIX + [90])
    assert ids(manager.get_computed_blocks(longer)) == [0, 1]


def test_a_freed_request_prefix_is_still_a_hit():
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", PREFIX + [90, 91, 92])
    allocate_prompt(manager, a)
    manager.free(a)
    b = make_request("b", PREFIX + [70])
    hits = manager.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    assert ids(manager.allocate_slots(b, 1, hits)) == [3]
    assert [blk.ref_cnt for blk in manager.block_pool.blocks[:4]] == [1, 1, 0, 1]
    assert manager.block_pool.num_free_blocks == 5


def test_without_caching_there_are_no_hits():
    manager = KVCacheManager(8, BLOCK_SIZE, enable_caching=False)
    a = make_request("a", PREFIX + [90, 91, 92])
    assert allocate_prompt(manager, a) == [0, 1, 2]
    b = make_request("b", PREFIX + [70, 71, 72])
    assert manager.get_computed_blocks(b) == []
    assert allocate_prompt(manager, b) == [3, 4, 5]
    assert all(blk.block_hash is None for blk in manager.block_pool.blocks)


def test_evicting_a_cached_block_makes_a_later_lookup_miss():
    manager = KVCacheManager(3, BLOCK_SIZE)
    a = make_request("a", PREFIX + [90])
    assert allocate_prompt(manager, a) == [0, 1, 2]
    manager.free(a)  # free queue: 2, 1, 0
    assert allocate_prompt(manager, make_request("x", [40, 41, 42])) == [2]
    assert allocate_prompt(manager, make_request("y", [50, 51, 52])) == [1]
    pool = manager.block_pool
    assert pool.get_cached_block(a.block_hashes[1]) is None
    assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[0]
    b = make_request("b", PREFIX + [70])
    assert ids(manager.get_computed_blocks(b)) == [0]


def test_blocks_are_registered_once_the_step_that_fills_them_is_scheduled():
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", PREFIX + [90])
    # A first chunk of 6 tokens fills only the first block.
    manager.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    pool = manager.block_pool
    assert pool.blocks[0].block_hash == a.block_hashes[0]
    assert pool.blocks[1].block_hash is None
    manager.allocate_slots(a, 3)
    assert pool.blocks[1].block_hash == a.block_hashes[1]
    assert pool.blocks[2].block_hash is None


def test_blocks_a_decode_fills_are_registered_as_they_fill_and_each_only_once(monkeypatch):
    """Decodes register the block each one fills (another request then hits it), and a
    step registers only blocks newly full: not the whole context again every step."""
    manager = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", PREFIX + [90])  # 9 tokens: blocks 0 and 1 full, block 2 started
    allocate_prompt(manager, a)
    registered = []
    original = manager.block_pool.cache_full_block
    monkeypatch.setattr(manager.block_pool, "cache_full_block",
                        lambda block, h: (registered.append(block.block_id), original(block, h)))
    for token in (91, 92, 93, 94, 95):  # block 2 fills with the 12th token, block 3 starts
        a.append_output_token(token)
        assert manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    assert registered == [2]
    b = make_request("b", a.all_token_ids[:12] + [7])
    assert ids(manager.get_computed_blocks(b)) == ids(manager.req_to_blocks["a"][:3])
    manager.free(a)
    # Scheduled again from the start (preempted), its blocks are registered anew.
    a.num_computed_tokens = 0
    registered.clear()
    allocate_prompt(manager, a)
    assert len(registered) == 3
