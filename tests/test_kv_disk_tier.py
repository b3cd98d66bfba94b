"""A disk KV tier behind the host's (--kv-offloading-disk-path, --kv-offloading-disk-size):
a block the host tier gives up moves to disk (findable there once its step lands), a load
reads it back bit for bit and checked, and offline a prefix the pool and the small host
tier both lost comes back from disk with the output of a run without tiers."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.core.kv_tier_index import KVTierIndex
from services.worker.kv_tier import HostKVTier
from test_kv_tier import H, family_models, run  # noqa: F401 - a fixture


def test_a_block_the_host_gives_up_moves_to_disk_and_is_found_there_once_landed():
    tier = KVTierIndex(2, 2)  # host slots 0-1, disk slots 2-3
    for h in H[:2]:
        tier.landed(tier.reserve(h, {}), ok=True)
    moves: dict[int, int] = {}
    slot = tier.reserve(H[2], moves)
    assert slot == 0 and moves == {0: 2}  # H[0], the least recently used, to a disk slot
    assert tier.find(H, 0, 1) == []  # in flight: neither here nor there
    tier.landed(slot, ok=True)
    tier.landed(2, ok=True)
    assert tier.find(H, 0, 3) == [2, 1, 0]  # one run across both files
    assert tier.find(H, 0, 3, host_only=True) == []  # (other hosts read the host file only)
    # The disk gives up its least recently used in turn, never a slot a load reads
    tier.pin([2])  # (a load from H[0]'s disk slot in flight)
    moves = {}
    tier.landed(tier.reserve(H[3], moves), ok=True)
    assert moves == {1: 3}  # H[1] to the free disk slot
    tier.landed(3, ok=True)
    moves = {}
    tier.landed(tier.reserve(H[4], moves), ok=True)
    assert moves == {0: 3}  # H[2] to disk: slot 2 is pinned, so H[1]'s slot 3 is reused
    tier.landed(3, ok=False)  # that step failed: H[2] is lost, its disk slot free again
    assert tier.find(H, 0, 1) == [2] and tier.find(H, 1, 2) == [] and tier.find(H, 2, 3) == []
    tier.unpin([2])
    assert len(tier) == 3  # H[0] on disk, H[3] and H[4] in the host's slots


def test_moved_blocks_load_back_from_the_disk_file_bit_for_bit(tmp_path):
    def cache(seed):
        return [torch.randn(2, 6, 4, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)]

    written, read = cache(0), cache(1)
    slot_bytes = 2 * 4 * 2 * 8 * 2
    host = HostKVTier(written, 2 * slot_bytes, str(tmp_path / "shm"), 4 * slot_bytes, str(tmp_path))
    other = HostKVTier(read, 2 * slot_bytes, str(tmp_path / "shm"), 4 * slot_bytes, str(tmp_path))  # its host's
    assert (host.num_slots, host.num_disk_slots) == (2, 4) and (tmp_path / "shm-disk").exists()
    host.store({0: 0, 1: 1})
    host.store({2: 0, 3: 1}, moves={0: 2, 1: 5})  # blocks 0 and 1 to disk slots 2 and 5 first
    assert other.load({0: 2, 1: 5, 2: 0, 3: 1}) == []
    assert torch.equal(read[0][:, :4].view(torch.int16), written[0][:, :4].view(torch.int16))
    other.disk.data[3, 7] ^= 1  # a flipped bit in disk slot 5 (the disk file's 3): refused
    assert other.load({4: 5}) == [4]
    own = HostKVTier(cache(2), 2 * slot_bytes, None, 4 * slot_bytes, str(tmp_path / "own"))  # a process's own
    assert own.num_disk_slots == 4 and not list((tmp_path / "own").iterdir())  # (unlinked once mapped)


def test_an_evicted_prefix_comes_back_from_the_disk_tier_with_the_same_output(family_models, tmp_path):
    """A host tier of 34 blocks (a step stores 32 at most here, so the prefix goes in
    whole): the three prompts after the prefix store 54 blocks, moving all 32 of the
    prefix's on to disk, and the last prompt loads every one from there."""
    from llmbus import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    plain, _ = run(family_models["llama"], False, params)
    folder = tmp_path / "disk"
    folder.mkdir()
    tiered, stats = run(family_models["llama"], True, params, kv_offloading_size=34.5 * 8192 / (1 << 30),
                        kv_offloading_disk_path=str(folder), kv_offloading_disk_size=0.01)
    assert tiered == plain
    assert stats.external_prefix_cache_hits == 32 * 16


def test_a_disk_tier_takes_both_flags_behind_a_host_tier():
    from shared.engine_args import EngineArgs

    with pytest.raises(ValueError, match="--kv-offloading-disk-path and --kv-offloading-disk-size go together"):
        EngineArgs(model="m", kv_offloading_size=1, kv_offloading_disk_path="/tmp")
    with pytest.raises(ValueError, match="behind a host tier"):
        EngineArgs(model="m", kv_offloading_disk_path="/tmp", kv_offloading_disk_size=1)


def test_a_look_leaves_the_least_recently_used_order_as_it_was():
    """Other hosts' tiers are looked at for every waiting request; only the one a request
    loads from has its blocks made the most recently used (services/scheduler/core/
    kv_cache_manager.py's tier_hits)."""
    tier = KVTierIndex(2)
    for h in H[:2]:
        tier.landed(tier.reserve(h), ok=True)
    assert tier.find(H, 0, 1, touch=False) == [0]  # H[0] looked at: still the least recently used
    assert tier.reserve(H[2]) == 0
    tier.landed(0, ok=True)
    assert tier.find(H, 1, 2) == [1]  # H[1] found (touched): H[2] is now the least recently used
    assert tier.reserve(H[3]) == 0
