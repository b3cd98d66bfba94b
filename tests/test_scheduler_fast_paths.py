"""The scheduler core's shortcuts change nothing: a decode whose blocks already hold its
tokens skips KVCacheManager.allocate_slots (its `quiet_until` bound), and every step,
output and cached block must be what the core gives calling it for every request."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from services.scheduler.engine_core import EngineCore
from services.worker.instant_runner import InstantRunner
from test_scheduler import BLOCK_SIZE, EOS, VOCAB, make_request, make_scheduler


class NeverQuiet(dict):
    """A quiet_until that has no bound: the core calls allocate_slots for every request."""

    def get(self, key, default=None):
        return -1


class Recorder:
    """The instant runner as an engine core's executor, keeping every step it is sent."""

    def __init__(self) -> None:
        self.runner = InstantRunner(VOCAB, EOS)
        self.steps: list[bytes] = []

    async def execute(self, step, headers):
        self.steps.append(msgspec.msgpack.encode(step))
        return self.runner.execute(step)


def workload(seed: int) -> list:
    """Requests sharing prefixes (prefix-cache hits, blocks shared), of lengths around
    block boundaries, some ended early by a stop token, more than the pool holds at once."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, EOS) for _ in range(rng.randrange(1, 3 * BLOCK_SIZE))] for _ in range(3)]
    requests = []
    for i in range(24):
        prompt = rng.choice(prefixes) + [rng.randrange(1, EOS) for _ in range(rng.randrange(0, 2 * BLOCK_SIZE))]
        params = {"max_tokens": rng.randrange(1, 4 * BLOCK_SIZE), "ignore_eos": True}
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(1, EOS)]
        requests.append(make_request(f"r{i}", prompt, **params))
    return requests


def run(seed: int, depth: int, prefix_caching: bool, shortcut: bool):
    scheduler = make_scheduler(num_kv_blocks=24, prefix_caching=prefix_caching, max_num_seqs=8)
    kv = scheduler.kv_cache_manager
    if not shortcut:
        kv.quiet_until = NeverQuiet()
    executor = Recorder()
    engine = EngineCore(scheduler, executor, depth)
    for request in workload(seed):
        scheduler.add_request(request)
    outputs = []

    async def drive():
        while engine.busy():
            landed = await engine.step()
            assert landed is not None
            outputs.extend(msgspec.structs.replace(o, queue_time_s=None, prefill_time_s=None)  # (clocks' figures)
                           for outs in landed.outputs.values() for o in outs.outputs)
            for rid, bound in kv.quiet_until.items():  # (never above the true bound)
                blocks, registered = kv.req_to_blocks[rid], kv.num_cached_blocks.get(rid, 0)
                true = len(blocks) * BLOCK_SIZE
                if prefix_caching:
                    true = min(true, (registered + 1) * BLOCK_SIZE - 1)
                assert bound <= true, (rid, bound, true)

    asyncio.run(drive())
    assert not scheduler.requests and not kv.quiet_until
    cached = sorted(kv.block_pool._cached) if prefix_caching else []
    return executor.steps, outputs, cached, scheduler.num_preemptions


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_skipping_allocate_slots_changes_nothing(seed, depth, prefix_caching):
    steps, outputs, cached, preemptions = run(seed, depth, prefix_caching, shortcut=True)
    reference = run(seed, depth, prefix_caching, shortcut=False)
    assert preemptions > 0 or seed  # (the pool is small enough that seed 0 preempts)
    assert (steps, outputs, cached, preemptions) == reference
