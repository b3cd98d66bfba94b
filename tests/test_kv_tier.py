"""The host KV tier (--kv-offloading-size): the scheduler's index of it, the worker's copies
in and out of it, and the offline engine with it: a prefix the pool evicted comes back from
the tier, counted under vLLM's external_prefix_cache_* names, with the output of a run
without the tier, greedy and seeded, for a Llama, a MoE, latent attention and a sliding
window."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.core.kv_tier_index import KVTierIndex, tier_of
from services.worker.kv_tier import HostKVTier
from tiny_models import build_tiny_model, random_prompts

H = [bytes([i]) * 16 for i in range(8)]  # block hashes


def test_a_stored_block_is_found_only_once_its_step_landed_well():
    tier = KVTierIndex(4)
    slot = tier.reserve(H[0])
    assert slot is not None
    assert tier.find(H, 0, 4) == []  # in flight: not findable
    assert tier.reserve(H[0]) is None  # nor stored twice
    tier.landed(slot, ok=True)
    assert tier.find(H, 0, 4) == [slot]
    assert tier.reserve(H[0]) is None  # held already
    failed = tier.reserve(H[1])
    tier.landed(failed, ok=False)  # the step failed: what it wrote is not trusted
    assert tier.find(H, 1, 4) == [] and len(tier) == 1


def test_hits_are_a_prefix_run_and_slots_are_reused_least_recently_used_never_while_pinned():
    tier = KVTierIndex(3)
    for h in H[:3]:
        tier.landed(tier.reserve(h), ok=True)
    assert tier.find(H, 0, 8) == [0, 1, 2]
    assert tier.find([H[0], H[5], H[2]], 0, 3) == [0]  # the first missing block ends the run
    tier.find(H, 1, 2)  # H[1] the most recently used now; H[2], then H[0], the least
    tier.pin([2])  # a load from H[2]'s slot is in a step
    slot = tier.reserve(H[3])
    assert slot == 0 and tier.find(H, 0, 1) == []  # H[0] went; H[2], pinned, stayed
    tier.landed(slot, ok=True)
    tier.pin([1])
    assert tier.reserve(H[4]) == 0  # H[3]'s slot, the one neither pinned nor in flight
    assert tier.reserve(H[5]) is None  # every slot pinned or in flight
    assert tier.num_busy_slots == 3
    tier.unpin([1, 2])
    tier.landed(0, ok=False)
    assert tier.num_busy_slots == 0 and tier.find(H, 1, 3) == [1, 2]


def test_workers_of_one_tier_share_its_index():
    tiers: dict[str, KVTierIndex] = {}
    a = tier_of("a", "host:/dev/shm/x", 10, tiers)
    assert tier_of("b", "host:/dev/shm/x", 10, tiers) is a
    assert tier_of("c", "host:/dev/shm/x", 12, tiers) is None  # another layout: not this index
    assert tier_of("d", "", 0, tiers) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_go_through_a_shared_file_bit_for_bit(tmp_path, dtype):
    def caches(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(2, 9, 4, 2, 8, generator=g).to(dtype), None,
                torch.randn(1, 9, 4, 1, 16, generator=g).to(dtype)]  # (a latent cache: one tensor for K and V)

    path = str(tmp_path / "tier")
    writer, reader = caches(0), caches(1)
    a, b = HostKVTier(writer, 1 << 20, path), HostKVTier(reader, 1 << 20, path)  # two workers of a host
    assert a.num_slots == b.num_slots and a.name == b.name
    a.store({3: 5, 7: 0})  # scattered: copied by index
    assert b.load({1: 5, 2: 0}) == []
    a.store({0: 1, 1: 2, 2: 3, 3: 4})  # a run: copied as one
    assert b.load({5: 1, 6: 2, 7: 3, 8: 4}) == []
    for w, r in zip(writer, reader):
        if w is not None:
            for written, read in ((3, 1), (7, 2), (0, 5), (1, 6), (2, 7), (3, 8)):
                assert torch.equal(r[:, read].view(torch.uint8), w[:, written].view(torch.uint8))
    with pytest.raises(ValueError, match="another layout"):
        HostKVTier(caches(0)[:1], 1 << 20, path)


def test_blocks_cross_hosts_over_tcp_bit_for_bit_with_a_one_time_token(tmp_path):
    """Two hosts' tiers (two files): blocks stored in one, loaded into another worker's
    cache through the first's server (services/worker/kv_transfer.py), the same bytes; a
    byte flipped in a slot is that block refused; a token used twice, or not signed for
    these slots, sends nothing, and every block of the load is refused."""
    from shared.kv_transfer_tokens import sign
    from shared.messages import RemoteKVLoad

    g = torch.Generator().manual_seed(0)
    writer = [torch.randn(2, 9, 4, 2, 8, generator=g), torch.randn(2, 9, 4, 2, 8, generator=g)]
    reader = [torch.zeros(2, 9, 4, 2, 8), torch.zeros(2, 9, 4, 2, 8)]
    a, b = HostKVTier(writer, 1 << 20, str(tmp_path / "a")), HostKVTier(reader, 1 << 20, str(tmp_path / "b"))
    a.store({0: 4, 1: 5, 2: 6, 5: 9})
    secret = b"k"
    address = a.serve(secret, "127.0.0.1")
    try:
        def load(orders, slots=None, token=None):
            signed, expires = sign(secret, address, slots or list(orders.values()))
            return b.load_remote(RemoteKVLoad(address, token or signed, expires, orders))

        assert load({3: 4, 4: 5, 7: 9}) == []
        for w, r in zip(writer, reader):
            for written, read in ((0, 3), (1, 4), (5, 7)):
                assert torch.equal(r[:, read], w[:, written])
        a.data[6, 100] ^= 0xFF  # (memory gone bad on the serving host)
        assert load({1: 6, 2: 4}) == [1]
        assert load({1: 4}, slots=[5]) == [1]  # a token for other slots
        token, _ = sign(secret, address, [4])
        assert load({1: 4}, token=token) == []
        assert load({1: 4}, token=token) == [1]  # (used once already)
        # A tier of another layout (another model's blocks) is sent nothing
        other = HostKVTier([torch.zeros(2, 9, 4, 2, 4)], 1 << 20, str(tmp_path / "c"))
        signed, expires = sign(secret, address, [4])
        assert other.load_remote(RemoteKVLoad(address, signed, expires, {1: 4})) == [1]
    finally:
        a.server.close()


def test_a_tensor_parallel_worker_s_rank_0_serves_each_rank_its_own_file_once_a_token(tmp_path):
    """Two ranks' files on the serving host (rank 1's named after rank 0's); each rank of a
    loading worker fetches its own heads of the same slots with the one token: rank r gets
    rank r's bytes, once; a rank the server has not is refused."""
    import numpy as np

    from services.worker.kv_tier import map_tier_file
    from services.worker.kv_transfer import TierServer, fetch_slots
    from shared.kv_transfer_tokens import sign

    g = torch.Generator().manual_seed(1)
    caches = [[torch.randn(2, 9, 4, 1, 8, generator=g)] for _ in range(2)]
    ranks = [HostKVTier(cache, 1 << 20, str(tmp_path / name)) for cache, name in zip(caches, ("t", "t-tp1"))]
    for tier in ranks:
        tier.store({2: 5, 3: 6})
    zero = ranks[0]
    server = TierServer(zero.data.numpy(), zero.checksums.numpy(), b"k", "127.0.0.1", ranks=2,
                        peer=lambda rank: map_tier_file(f"{zero.path}-tp{rank}"))
    try:
        token, expires = sign(b"k", server.address, [5, 6])

        def fetch(rank):
            into = np.zeros((2, zero.slot_bytes), np.uint8)
            fetch_slots(server.address, token, expires, [5, 6], into, zero.slot_bytes, rank=rank)
            return into

        for rank, tier in enumerate(ranks):
            assert np.array_equal(fetch(rank), tier.data[5:7].numpy())
        for rank in (1, 2):  # (used once already; a rank it has not)
            with pytest.raises(ConnectionError):
                fetch(rank)
    finally:
        server.close()


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier_models")
    return {name: build_tiny_model(root / name, name) for name in ("llama", "qwen3_moe", "deepseek_v3", "gemma2")}


def run(folder, tier: bool, params, tensor_parallel_size: int = 1, **tier_args) -> tuple[list[list[int]], object]:
    from llmbus import LLM

    # A pool of 40 blocks of 16: the 512-token prefix (32 blocks) is evicted by the three
    # prompts after it, then asked again.
    llm = LLM(str(folder), num_kv_blocks=40, block_size=16, max_model_len=1024,
              tensor_parallel_size=tensor_parallel_size,
              **({"kv_offloading_size": 0.02, **tier_args} if tier else {}))
    prefix = random_prompts([512], seed=1)[0]
    prompts = [prefix + [5, 6], *random_prompts([300, 300, 300], seed=2), prefix + [7, 8]]
    outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
               for p in prompts]
    stats = llm.stats()
    llm.executor.close()
    return outputs, stats


def test_a_tensor_parallel_worker_s_ranks_each_store_and_load_their_heads(family_models):
    """Two ranks, each with a tier of its own heads under the scheduler's one index: the
    evicted prefix comes back from the tiers with one rank's output without a tier."""
    from llmbus import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    plain, _ = run(family_models["llama"], False, params)
    tiered, stats = run(family_models["llama"], True, params, tensor_parallel_size=2)
    assert tiered == plain
    assert stats.external_prefix_cache_hits == 32 * 16


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3", "gemma2"])
def test_an_evicted_prefix_comes_back_from_the_tier_with_the_same_output(family_models, family):
    from llmbus import SamplingParams

    folder = family_models[family]
    for params in (SamplingParams(max_tokens=8, temperature=0),
                   SamplingParams(max_tokens=8, temperature=1.0, seed=7)):
        plain, plain_stats = run(folder, False, params)
        tiered, stats = run(folder, True, params)
        assert tiered == plain
        assert plain_stats.prefix_cache_hits == 0  # (the pool alone lost the prefix)
        assert stats.external_prefix_cache_hits == 32 * 16  # the whole prefix, from the tier
        assert stats.prefix_cache_hits == stats.external_prefix_cache_hits
        assert stats.external_prefix_cache_queries == sum(514 if i in (0, 4) else 300 for i in range(5))


def test_a_prefilled_request_is_handed_to_a_decode_worker_with_every_computed_token_loaded():
    """The scheduler's side of disaggregation, with exact steps: the prefill worker stores the
    prompt's full blocks and its partial last block; once its first token lands the request
    moves to the decode worker, whose first step loads them all and computes one token."""
    from services.scheduler.shell.fleet import Fleet
    from shared.config import SchedulerConfig
    from shared.messages import EngineCoreRequest, ModelRunnerOutput, WorkerInfo
    from shared.sampling_params import SamplingParams

    def info(worker_id: str, role: str) -> WorkerInfo:
        return WorkerInfo(worker_id, "tiny", 64, 4, max_model_len=1024, vocab_size=100, kv_tier="host:/tier",
                          kv_tier_slots=32, kv_role=role)

    fleet = Fleet(SchedulerConfig(max_model_len=512))
    fleet.heard_from(info("p", "kv_producer"), now=0.0)
    fleet.heard_from(info("d", "kv_consumer"), now=0.0)
    fleet.submit(EngineCoreRequest("a", list(range(1, 11)), SamplingParams(max_tokens=4), reply_subject="out"), 0.0)
    producer, consumer = fleet.workers["p"], fleet.workers["d"]
    assert fleet.owner["a"] is producer
    step = producer.core.schedule()
    assert step.num_scheduled_tokens == {"a": 10} and len(step.kv_stores) == 3  # 2 full blocks and the tail
    assert producer.core.schedule().num_scheduled_tokens == {}  # it decodes elsewhere: no step of its own
    producer.core.update_from_output(step, ModelRunnerOutput(step.step_id, ["a"], [[42]], [[]]))
    assert fleet.hand_off(producer) == ([consumer], []) and fleet.owner["a"] is consumer
    assert producer.core.schedule().finished_req_ids == ["a"]  # its worker drops it
    first = consumer.core.schedule()
    assert first.num_scheduled_tokens == {"a": 1}  # the first token only: no prompt token again
    assert sorted(first.kv_loads.values()) == sorted(step.kv_stores.values())
    new = first.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 10 and list(first.kv_loads) == new.block_ids[:3]
    assert consumer.core.make_stats().external_prefix_cache_hits == 10


def test_a_block_corrupted_in_the_tier_is_never_used(family_models, caplog):
    """A test flips one byte of every block the tier holds: each fails its checksum where it is
    loaded, and the requests that read it (two sharing the prefix, admitted in one step) are
    computed again, with the output of a run without the tier."""
    from llmbus import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    prefix = random_prompts([512], seed=1)[0]
    asked = [{"prompt_token_ids": prefix + tail} for tail in ([7, 8], [9, 10])]
    plain = LLM(str(family_models["llama"]), num_kv_blocks=80, block_size=16, max_model_len=1024)
    expected = [o.outputs[0].token_ids for o in plain.generate(asked, params, use_tqdm=False)]
    llm = LLM(str(family_models["llama"]), num_kv_blocks=80, block_size=16, max_model_len=1024,
              kv_offloading_size=0.02)
    llm.generate([{"prompt_token_ids": prefix + [5, 6]}], params, use_tqdm=False)  # stored to the tier
    assert llm.reset_prefix_cache()  # (the pool forgets it: the tier alone holds it)
    tier, index = llm.runner.kv_tier, llm.scheduler.kv_cache_manager.tier
    stored = len(index)
    assert stored >= 32
    tier.data[:, 100] ^= 1  # one byte of every slot
    with caplog.at_level("WARNING"):
        assert [o.outputs[0].token_ids for o in llm.generate(asked, params, use_tqdm=False)] == expected
    assert "32 block(s) failed their checksum; 2 request(s) computed again" in caplog.text
    assert llm.scheduler.kv_cache_manager.block_pool.num_free_blocks == 80
    # The bad slots are found no more; the blocks computed again went to the tier in their
    # place, and load cleanly now
    assert llm.reset_prefix_cache()
    hits = llm.stats().external_prefix_cache_hits
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert [o.outputs[0].token_ids for o in llm.generate(asked[:1], params, use_tqdm=False)] == expected[:1]
    assert llm.stats().external_prefix_cache_hits - hits == 512
    assert "checksum" not in caplog.text
    assert len(index) == stored


@pytest.mark.parametrize("family,hosts", [("llama", 1), ("qwen3_moe", 1), ("deepseek_v3", 1), ("gemma2", 1),
                                          ("llama", 2), ("deepseek_v3", 2)])
def test_disaggregated_steps_give_one_worker_s_output(family_models, family, hosts, tmp_path):
    """Prefill and decode on two model runners (the fleet and the runners in process,
    stepped in turn), of one host (one tier file) or of two (a tier each: the decode worker
    loads the prompt's blocks from the prefill worker's tier over TCP, with a token the
    scheduler signed): greedy and seeded outputs equal the offline engine's, and no step of
    the decode worker computes a prompt token."""
    from llmbus import LLM, SamplingParams
    from services.scheduler.shell.fleet import Fleet
    from services.worker.model_runner import ModelRunner
    from shared.config import CacheConfig, SchedulerConfig, WorkerConfig
    from shared.messages import EngineCoreRequest

    folder = family_models[family]
    prompts = random_prompts([37, 80, 16, 130], seed=4)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)]
    plain = LLM(str(folder), num_kv_blocks=64, block_size=16, max_model_len=1024)
    expected = {f"{i}-{j}": out.outputs[0].token_ids for j, p in enumerate(params)
                for i, out in enumerate(plain.generate([{"prompt_token_ids": t} for t in prompts], p,
                                                       use_tqdm=False))}
    runners, secret = {}, b"the deployment's"
    for worker_id, role in (("p", "kv_producer"), ("d", "kv_consumer")):
        cache = CacheConfig(num_kv_blocks=64, block_size=16, kv_offloading_size=1 << 24,
                            kv_offloading_path=str(tmp_path / ("tier" if hosts == 1 else f"tier-{worker_id}")))
        runners[worker_id] = ModelRunner(folder, WorkerConfig(cache, max_model_len=1024, kv_role=role))
    fleet = Fleet(SchedulerConfig(max_model_len=1024), transfer_secret=secret if hosts == 2 else None)
    for worker_id, runner in runners.items():
        info = runner.describe(worker_id, "tiny")
        if hosts == 2:
            info.kv_tier_address = runner.kv_tier.serve(secret, "127.0.0.1")
        fleet.heard_from(info, now=0.0)
    remote_loads = 0
    for j, p in enumerate(params):
        for i, tokens in enumerate(prompts):
            fleet.submit(EngineCoreRequest(f"{i}-{j}", tokens, p, eos_token_id=None, reply_subject="out"), 0.0)
    got: dict[str, list[int]] = {rid: [] for rid in expected}
    decode_steps = 0
    for _ in range(200):
        for worker_id, runner in runners.items():
            handle = fleet.workers[worker_id]
            if not handle.core.has_work():
                continue
            step = handle.core.schedule()
            if worker_id == "d" and step.num_scheduled_tokens:
                decode_steps += 1
                assert set(step.num_scheduled_tokens.values()) == {1}  # decodes only
                remote_loads += sum(len(load.orders) for load in step.kv_remote_loads)
                assert not (hosts == 2 and step.kv_loads)  # (its own tier holds none of them)
            for outputs in handle.core.update_from_output(step, runner.execute_model(step)).values():
                for output in outputs.outputs:
                    got[output.request_id] += output.new_token_ids
            fleet.hand_off(handle)
        if not any(h.core.has_work() for h in fleet.workers.values()):
            break
    assert got == expected
    assert decode_steps >= 5
    assert (remote_loads > 0) == (hosts == 2)
    for runner in runners.values():
        if runner.kv_tier.server is not None:
            runner.kv_tier.server.close()


def test_a_draining_worker_hands_a_request_over_mid_prefill_with_just_what_it_computed():
    """A worker leaves while a prompt is half prefilled (chunked): the hand-over stores the
    blocks of the tokens computed so far, the last one partial, and the worker that takes it
    loads exactly those and computes the rest of the prompt."""
    from services.scheduler.shell.fleet import Fleet
    from shared.config import SchedulerConfig
    from shared.messages import EngineCoreRequest, ModelRunnerOutput, WorkerInfo
    from shared.sampling_params import SamplingParams

    def info(worker_id: str, draining: bool = False) -> WorkerInfo:
        return WorkerInfo(worker_id, "tiny", 64, 4, max_model_len=1024, vocab_size=100, kv_tier="host:/tier",
                          kv_tier_slots=32, draining=draining)

    fleet = Fleet(SchedulerConfig(max_model_len=512, max_num_batched_tokens=10, long_prefill_token_threshold=10))
    fleet.heard_from(info("a"), now=0.0)
    fleet.submit(EngineCoreRequest("r", list(range(1, 41)), SamplingParams(max_tokens=4), reply_subject="out"), 0.0)
    fleet.heard_from(info("b"), now=0.0)
    a = fleet.workers["a"]
    chunk = a.core.schedule()
    assert chunk.num_scheduled_tokens == {"r": 10}  # 2 full blocks of 4 and half of the third
    a.core.update_from_output(chunk, ModelRunnerOutput(chunk.step_id, ["r"], [[]], [[]]))
    assert fleet.heard_from(info("a", draining=True), now=1.0) == []
    over = a.core.schedule()
    assert over.num_scheduled_tokens == {} and over.finished_req_ids == ["r"] and len(over.kv_stores) == 1  # the tail
    a.core.update_from_output(over, ModelRunnerOutput(over.step_id, [], [], []))
    targets, rejected = fleet.hand_off(a)
    b = fleet.workers["b"]
    assert targets == [b] and rejected == [] and "a" not in fleet.workers  # drained: gone
    step = b.core.schedule()
    new = step.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 10 and step.num_scheduled_tokens == {"r": 10}  # the prompt goes on from 10
    assert len(step.kv_loads) == 3 and list(step.kv_loads) == new.block_ids[:3]


def test_a_prompt_with_little_left_to_compute_is_prefilled_where_it_decodes():
    """Dynamo's conditional disaggregation (--max-local-prefill-length): a new prompt with at
    most that many tokens left to compute on a decode worker, its prefix cache counted, is
    prefilled there; the rest go to the prefill worker."""
    from services.scheduler.shell.fleet import Fleet
    from shared.config import SchedulerConfig
    from shared.messages import EngineCoreRequest, ModelRunnerOutput, WorkerInfo
    from shared.sampling_params import SamplingParams

    fleet = Fleet(SchedulerConfig(max_model_len=512, max_local_prefill_length=8))
    for worker_id, role in (("p", "kv_producer"), ("d", "kv_consumer")):
        fleet.heard_from(WorkerInfo(worker_id, "tiny", 64, 4, max_model_len=1024, vocab_size=100,
                                    kv_tier="host:/tier", kv_tier_slots=32, kv_role=role), now=0.0)
    producer, consumer = fleet.workers["p"], fleet.workers["d"]

    def submit(request_id: str, prompt: list[int]):
        fleet.submit(EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=2), reply_subject="out"), 0.0)
        return fleet.owner[request_id]

    assert submit("short", list(range(1, 9))) is consumer  # 8 tokens: computed where it decodes
    assert not consumer.core.requests["short"].decode_elsewhere
    step = consumer.core.schedule()
    consumer.core.update_from_output(step, ModelRunnerOutput(step.step_id, ["short"], [[42]], [[]]))
    # 14 tokens, the first 8 cached on the decode worker: 6 left there
    assert submit("cached", [*range(1, 9), *range(50, 56)]) is consumer
    assert submit("long", list(range(60, 74))) is producer  # 14, none cached
    assert producer.core.requests["long"].decode_elsewhere


def test_a_deployment_s_tier_files_go_with_it_its_ranks_files_too():
    from pathlib import Path

    from shared.kv_tier_files import remove_tier_files, tier_path

    base = Path(tier_path("nats://test-only:1", "llmbus.test", 0))
    files = [base, Path(f"{base}-tp1"), Path(f"{base}-tp2")]
    for file in files:
        file.write_bytes(b"x")
    remove_tier_files("nats://test-only:1", "llmbus.test", 1)
    assert not any(file.exists() for file in files)
