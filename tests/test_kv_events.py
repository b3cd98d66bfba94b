"""KV cache events (vLLM's --kv-events-config, shared/kv_events.py): replaying what a
scheduler's pools recorded, batch by batch over the wire, rebuilds each worker's cached
set exactly — under prefix hits, preemption-free eviction pressure, aborts and a reset —
and a snapshot plus the batches after it does the same."""

from __future__ import annotations

import random

import msgspec
import pytest

from services.scheduler.core.block_pool import hash_block_tokens
from shared.bus import encode
from shared.kv_events import (AllBlocksCleared, BlockStored, KVEventBatch, KVEventIndex, KVEventsConfig,
                              KVEventSnapshot)
from test_scheduler import make_request, make_scheduler, step

DECODE = msgspec.msgpack.Decoder(KVEventBatch)


def cached_set(scheduler) -> set[bytes]:
    return set(scheduler.kv_cache_manager.block_pool.cached_blocks())


def publish(scheduler, seq: int, worker_id: str = "w1") -> KVEventBatch:
    """One batch as the shell sends it, through msgpack and back."""
    events = scheduler.kv_cache_manager.block_pool.take_events()
    return DECODE.decode(encode(KVEventBatch(1.0, events, 0, worker_id, seq)))


@pytest.mark.parametrize("seed", range(4))
def test_replaying_the_events_rebuilds_the_cached_set_exactly(seed):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_kv_blocks=24, max_num_seqs=4)
    scheduler.kv_cache_manager.block_pool.events = []
    index, seq = KVEventIndex(), 0
    prefixes = [[rng.randrange(90) for _ in range(32)] for _ in range(3)]  # shared by many: hits
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.choice((16, 32))] + [rng.randrange(90) for _ in range(rng.randrange(1, 20))]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 12)))
        if rng.random() < 0.1:
            scheduler.abort_requests([f"r{rng.randrange(i + 1)}"])
        step(scheduler)
        seq += 1
        assert index.apply(publish(scheduler, seq))
        assert index.blocks.get("w1", set()) == cached_set(scheduler), i
    while scheduler.requests:
        step(scheduler)
    seq += 1
    index.apply(publish(scheduler, seq))
    assert index.blocks["w1"] == cached_set(scheduler) and cached_set(scheduler)
    assert scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
    seq += 1
    batch = publish(scheduler, seq)
    assert isinstance(batch.events[-1], AllBlocksCleared)
    index.apply(batch)
    assert index.blocks["w1"] == set()


def test_a_stored_block_says_its_parent_and_tokens_as_vllm_s_event_does():
    scheduler = make_scheduler(num_kv_blocks=16)
    scheduler.kv_cache_manager.block_pool.events = []
    bs = scheduler.kv_cache_manager.block_size
    prompt = list(range(2 * bs + 1))  # two full blocks before the last token
    scheduler.add_request(make_request("a", prompt, max_tokens=1))
    step(scheduler)
    stored = [e for e in publish(scheduler, 1).events if isinstance(e, BlockStored)]
    first = hash_block_tokens(None, prompt[:bs])
    assert [e.block_hashes for e in stored] == [[first], [hash_block_tokens(first, prompt[bs:2 * bs])]]
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == first
    assert stored[1].token_ids == prompt[bs:2 * bs] and stored[1].block_size == bs


def test_a_snapshot_then_the_batches_after_it_hold_the_cache_and_a_gap_is_noticed():
    scheduler = make_scheduler(num_kv_blocks=16)
    scheduler.kv_cache_manager.block_pool.events = []
    scheduler.add_request(make_request("a", list(range(40)), max_tokens=2))
    step(scheduler)
    scheduler.kv_cache_manager.block_pool.take_events()  # (went out as batch 1)
    snapshot = KVEventSnapshot(1, [KVEventBatch(1.0, [AllBlocksCleared(), BlockStored(
        sorted(cached_set(scheduler)), None, [], 16)], 0, "w1")])
    index = KVEventIndex()
    index.apply_snapshot(msgspec.msgpack.decode(encode(snapshot), type=KVEventSnapshot))
    scheduler.add_request(make_request("b", list(range(50, 90)), max_tokens=1))
    step(scheduler)
    assert index.apply(publish(scheduler, 2)) and index.blocks["w1"] == cached_set(scheduler)
    assert not index.apply(KVEventBatch(1.0, [], 0, "w1", 4))  # batch 3 missed: ask for a snapshot


def test_the_config_takes_vllm_s_switch_and_refuses_what_it_does_not_do():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publisher == "nats"
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    with pytest.raises(ValueError, match="zmq"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    with pytest.raises(ValueError, match="endpoint"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_served_scheduler_s_events_rebuild_its_workers_caches(tiny_llama):
    """Real processes: `llmbus scheduler --kv-events-config ...` with two workers; a consumer
    on the bus applies a snapshot and then every batch, and holds what a fresh snapshot says."""
    import asyncio

    import nats

    from deployment import Deployment, completion_texts
    from shared.bus import Subjects

    subjects = Subjects("tiny")
    d = Deployment(str(tiny_llama), scheduler_args=["--kv-events-config", '{"enable_kv_cache_events": true}'],
                   worker_args=["--num-kv-blocks", "24"], num_workers=2)
    try:
        d.wait_healthy()

        async def run() -> tuple[KVEventIndex, KVEventSnapshot, int]:
            nc = await nats.connect(d.nats.url)
            index, batches = KVEventIndex(), []

            async def on_batch(msg) -> None:
                batches.append(DECODE.decode(msg.data))

            await nc.subscribe(subjects.kv_events(0), cb=on_batch)
            await nc.flush()
            snapshot = msgspec.msgpack.decode((await nc.request(subjects.kv_snapshot(0), b"", timeout=5)).data,
                                              type=KVEventSnapshot)
            index.apply_snapshot(snapshot)
            prompts = [f"the {i % 3} shared beginning of a prompt that fills blocks, then {i}" for i in range(24)]
            await asyncio.to_thread(completion_texts, d.base_url, prompts, model="tiny", max_tokens=8)
            await asyncio.sleep(1.0)  # (the batches of the last steps, and a heartbeat's)
            final = msgspec.msgpack.decode((await nc.request(subjects.kv_snapshot(0), b"", timeout=5)).data,
                                           type=KVEventSnapshot)
            await asyncio.sleep(0.3)
            for batch in sorted(batches, key=lambda b: b.seq):
                assert index.apply(batch), batch.seq
            await nc.close()
            return index, final, len(batches)

        index, final, num_batches = asyncio.run(run())
        truth = KVEventIndex()
        truth.apply_snapshot(final)
        assert num_batches >= 2 and index.seq == final.seq  # (at least a batch a worker: both cache)
        assert len(truth.blocks) == 2 and all(truth.blocks.values())  # both workers cache something
        assert index.blocks == truth.blocks
    finally:
        d.close()


def test_a_worker_s_blocks_cached_before_the_first_flush_and_after_a_rejoin_are_all_published():
    """The shard's publisher (with a recording bus): a pool records from its core's birth,
    so blocks cached between a worker joining (or rejoining afresh) and the next flush reach
    the consumers."""
    import asyncio

    from services.scheduler.shell.fleet import Fleet
    from services.scheduler.shell.kv_event_publisher import KVEventPublisher
    from shared.bus import Subjects
    from shared.config import SchedulerConfig
    from shared.messages import EngineCoreRequest, WorkerInfo
    from shared.sampling_params import SamplingParams

    class Bus:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def publish(self, subject: str, data: bytes) -> None:
            self.sent.append(data)

    bus = Bus()
    fleet = Fleet(SchedulerConfig(max_model_len=512), kv_events=True)
    publisher = KVEventPublisher(bus, Subjects("tiny"), 0, fleet.workers)
    index = KVEventIndex()

    def run(incarnation: int, request_id: str) -> None:
        fleet.heard_from(WorkerInfo("w1", "tiny", 64, 4, 1024, 100, incarnation=incarnation), now=0.0)
        fleet.submit(EngineCoreRequest(request_id, list(range(1, 14)), SamplingParams(max_tokens=2)), now=0.0)
        fleet.workers["w1"].core.schedule()  # the prompt's full blocks cached, before any flush
        asyncio.run(publisher.flush())
        for data in bus.sent:
            assert index.apply(DECODE.decode(data))
        bus.sent.clear()

    run(1, "a")
    assert index.blocks["w1"] == cached_set(fleet.workers["w1"].core) and len(index.blocks["w1"]) == 3
    run(2, "b")  # it reconnected: a fresh core, its old cache gone
    assert index.blocks["w1"] == cached_set(fleet.workers["w1"].core) and len(index.blocks["w1"]) == 3
