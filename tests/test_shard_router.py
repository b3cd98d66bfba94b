"""How a gateway picks a scheduler shard (services/gateway/shard_router.py): cache first,
then load, from the shards' own heartbeats and reports."""

from __future__ import annotations

import random

from services.gateway.shard_router import ShardRouter
from shared.prefix_affinity import block_chain
from shared.messages import SchedulerHeartbeat
from shared.shards import rendezvous, shard_of


def router(num_shards: int = 2, seed: int = 0, workers: int = 1) -> ShardRouter:
    r = ShardRouter(timeout_s=2.5, rng=random.Random(seed))
    for rank in range(num_shards):
        r.heard(SchedulerHeartbeat(f"s{rank}", workers, 0, rank, 0), now=0.0)
    return r


def prompt(seed: int, length: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def test_unrelated_prompts_spread_evenly():
    r = router()
    counts = [0, 0]
    for i in range(64):
        counts[r.route(prompt(i), None, now=0.1)] += 1
    assert max(counts) <= 1.3 * min(counts), counts


def test_a_shared_prefix_lands_where_it_was_sent_while_loads_allow():
    r = router()
    for group in range(8):
        prefix = prompt(1000 + group, 256)
        ranks = {r.route(prefix + prompt(i, 16), None, now=0.1) for i in range(4)}
        assert len(ranks) == 1, group
    # each group whole on one shard, and the groups' first requests by load: 4 groups each
    assert (r.shards[0].load, r.shards[1].load) == (16, 16)


def test_affinity_yields_to_an_overloaded_shard():
    r = router()
    prefix = prompt(7, 256)
    first = r.route(prefix, None, now=0.1)
    r.reported(first, 40)  # that shard is busy now
    r.reported(1 - first, 2)
    assert r.route(prefix + [1, 2, 3], None, now=0.2) == 1 - first


def test_a_lora_adapter_s_prompts_chain_apart_from_the_base_model_s():
    base = prompt(3, 128)
    assert len(block_chain(base, None)) == 8 and block_chain(base[:20], None) == block_chain(base, None)[:1]
    assert set(block_chain(base, "sql")).isdisjoint(block_chain(base, None))


def test_a_shard_without_workers_or_gone_silent_gets_nothing():
    r = router()
    r.heard(SchedulerHeartbeat("s1", 0, 0, 1, 0), now=0.5)  # shard 1's last worker left
    assert {r.route(prompt(i), None, now=0.6) for i in range(20)} == {0}
    r = router()
    r.heard(SchedulerHeartbeat("s0", 1, 0, 0, 0), now=3.0)  # shard 1 silent since 0.0
    assert {r.route(prompt(i), None, now=3.1) for i in range(20)} == {0}
    assert r.silent(now=3.1) == [1] and set(r.shards) == {0}
    r = router()
    r.heard(SchedulerHeartbeat("s1", 0, 0, 1, 0), now=0.5)  # shard 1's beat before its worker joined
    r.answered(1, 1)  # ... and its answer to /health's question after
    assert {r.route(prompt(i), None, now=0.6) for i in range(20)} == {0, 1}


def test_a_new_scheduler_on_a_shard_or_a_reconnect_asks_for_its_requests_again():
    r = router()
    assert r.heard(SchedulerHeartbeat("s0", 1, 0, 0, 0), now=0.5) is None
    assert "took shard 0 over" in r.heard(SchedulerHeartbeat("s0-new", 1, 0, 0, 0), now=0.6)
    assert "reconnected" in r.heard(SchedulerHeartbeat("s0-new", 1, 1, 0, 0), now=0.7)


def test_each_gateway_counts_what_it_sent_until_the_shard_reports():
    r = router()
    for i in range(10):
        r.route(prompt(i), None, now=0.1)
    assert r.shards[0].load + r.shards[1].load == 10
    r.reported(0, 3)
    assert r.shards[0].load == 3


def test_workers_without_a_rank_spread_over_shards_by_their_ids():
    assert shard_of("w1", 4, 2) == 2
    ranks = [shard_of(f"worker-{i}", 4) for i in range(400)]
    assert all(ranks.count(rank) > 60 for rank in range(4))
    # a shard that goes away moves only its own keys
    keys = [f"k{i}" for i in range(200)]
    before = {k: rendezvous(k, [0, 1, 2]) for k in keys}
    after = {k: rendezvous(k, [0, 1]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != 2)


def test_a_report_older_than_the_requests_still_on_their_way_does_not_hide_them():
    """A shard's report resets what this gateway sent it since, but may predate requests
    still on their way there: the gateway's own open requests on each shard are a floor."""
    r = router()
    held = {0: 0, 1: 0}
    for i in range(40):
        rank = r.route(prompt(i), None, now=0.1, held=held)
        held[rank] += 1
        if i % 5 == 4:  # shard 0's reports miss the last few it was sent; shard 1's are current
            r.reported(0, max(held[0] - 3, 0))
            r.reported(1, held[1])
    assert held == {0: 20, 1: 20}


def _events_of(scheduler, rank: int, seq: int):
    """A scheduler's recorded KV events as its shard publishes them (through msgpack)."""
    import msgspec

    from shared.bus import encode
    from shared.kv_events import KVEventBatch

    events = scheduler.kv_cache_manager.block_pool.take_events()
    return msgspec.msgpack.decode(encode(KVEventBatch(1.0, events, rank, "w1", seq)), type=KVEventBatch)


def test_a_prompt_goes_where_the_shards_kv_events_say_its_prefix_is_cached():
    """Shard 1's worker computed a prompt (a real scheduler's events, with a cache salt): a
    gateway that never sent it anything — another gateway's request — routes the prompt
    and its continuations there, while loads allow; the same prompt under another salt, or
    an unrelated one, does not follow."""
    import msgspec

    from test_scheduler import BLOCK_SIZE, make_request, make_scheduler, step

    scheduler = make_scheduler()
    scheduler.kv_cache_manager.block_pool.events = []  # (the shell turns recording on: --kv-events-config)
    base = [t % 100 for t in prompt(7, 96)]  # (the test scheduler's vocabulary)
    scheduler.add_request(msgspec.structs.replace(make_request("r", base, max_tokens=1), cache_salt="tenant-a"))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    batch = _events_of(scheduler, rank=1, seq=1)
    for seed in range(8):  # (by load alone, each fresh router would pick shard 1 half the time)
        r = router(seed=seed)
        assert r.caches.apply(batch)
        assert [r.route(base + [i], None, now=0.1, cache_salt="tenant-a") for i in range(4)] == [1] * 4
    assert r.caches.cached_blocks(1, r.caches.chain(base, "tenant-a")) == len(base) // BLOCK_SIZE
    assert r.caches.cached_blocks(1, r.caches.chain(base, "tenant-b")) == 0
    other = router(seed=3)
    other.caches.apply(batch)
    assert [other.route(prompt(100 + i), None, now=0.1) for i in range(6)].count(1) < 6  # (by load, spread)
    # over the imbalance bound: the least loaded shard instead
    loaded = router(seed=3)
    loaded.caches.apply(batch)
    loaded.reported(1, 40)
    assert loaded.route(base, None, now=0.1, cache_salt="tenant-a") == 0


def test_the_gateway_s_block_chain_is_the_scheduler_s():
    import msgspec

    from shared.block_hashes import prompt_block_hashes
    from test_scheduler import BLOCK_SIZE, make_request, make_scheduler

    scheduler = make_scheduler()
    for salt in (None, "x"):
        tokens = [t % 100 for t in prompt(9, 70)]
        scheduler.add_request(msgspec.structs.replace(make_request(f"q{salt}", tokens), cache_salt=salt))
        request = scheduler.requests[f"q{salt}"]
        scheduler.kv_cache_manager.update_block_hashes(request)
        assert request.block_hashes == prompt_block_hashes(tokens, BLOCK_SIZE, salt)
        assert len(request.block_hashes) == 70 // BLOCK_SIZE


def test_missed_kv_event_batches_ask_for_a_snapshot_and_a_new_scheduler_s_are_forgotten():
    from shared.kv_events import BlockStored, KVEventBatch

    r = router()
    stored = BlockStored([b"h" * 16], None, [1] * 16, 16)
    assert r.caches.apply(KVEventBatch(1.0, [stored], 0, "w", 1))
    assert not r.caches.apply(KVEventBatch(1.0, [stored], 0, "w", 3))  # (2 never came)
    r.heard(SchedulerHeartbeat("another", 1, 0, 0, 0), now=0.2)  # a new scheduler took shard 0 over
    assert 0 not in r.caches.indexes


def test_a_prompt_s_images_chain_apart_and_route_apart():
    """Two prompts of the same tokens with other images hold other K/V: their chains part
    at the image's block, and the second does not follow the first's shard."""
    from shared.messages import ImageFeature

    tokens = prompt(5, 128)
    cat, dog = [ImageFeature("cat", 20, 8, [1])], [ImageFeature("dog", 20, 8, [1])]
    assert block_chain(tokens, None, mm_features=cat)[:1] == block_chain(tokens, None)[:1]  # (before it: alike)
    assert set(block_chain(tokens, None, mm_features=cat)[1:]).isdisjoint(block_chain(tokens, None, mm_features=dog))
    r = router()
    first = r.route(tokens, None, now=0.1, mm_features=cat)
    assert r.route(tokens, None, now=0.1, mm_features=cat) == first  # (its prefix, images and all)
    assert r.route(tokens, None, now=0.1, mm_features=dog) != first  # (the least loaded: nothing shared past block 0)
