"""--tensor-parallel-size N: a worker of N ranks (processes in one gloo group here; NCCL on
GPUs), each holding a slice of every layer and of the KV cache. Held to the oracle: greedy
output equals transformers' token for token, family by family, with two ranks; seeded
sampling equals one rank's; served, a rank's death takes the worker down as one and the
streams end as an undisturbed run's."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from pathlib import Path

import pytest
import torch

from llmbus import LLM, SamplingParams
from services.worker.models.decoder_config import ModelConfig
from services.worker.parallel.sharding import Shards, local_config
from draft_recorder import rank0_runner
from tiny_models import build_tiny_model, hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(600)

PROMPTS = random_prompts([3, 17, 40, 65], vocab_size=380, seed=7)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(arch: str, **overrides) -> Path:
        key = arch + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
        if key not in made:
            made[key] = build_tiny_model(tmp_path_factory.mktemp(key), arch, **overrides)
        return made[key]

    return folder


def _config(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=12,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6,
                rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, o_bias=False)
    return ModelConfig(**{**base, **fields})


def test_the_ranks_slices_put_together_are_the_checkpoint_s_tensors():
    config = _config()
    q, k, o, gate_up = torch.randn(16, 16), torch.randn(8, 16), torch.randn(16, 16), torch.randn(24, 16)
    cuts = [Shards(config, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([c.cut("model.layers.0.self_attn.q_proj.weight", q) for c in cuts]), q)
    assert torch.equal(torch.cat([c.cut("model.layers.0.self_attn.k_proj.weight", k) for c in cuts]), k)
    assert torch.equal(torch.cat([c.cut("model.layers.0.self_attn.o_proj.weight", o) for c in cuts], 1), o)
    bias = torch.randn(16)  # (o_proj's bias is whole on every rank: rank 0 alone adds it)
    assert all(torch.equal(c.cut("model.layers.0.self_attn.o_proj.bias", bias), bias) for c in cuts)
    # A fused checkpoint tensor (Phi-3's): each part cut apart, gate rows with their up rows
    halves = [c.cut("model.layers.0.mlp.gate_up_proj.weight", gate_up) for c in cuts]
    assert torch.equal(torch.cat([h[:6] for h in halves]), gate_up[:12])
    assert torch.equal(torch.cat([h[6:] for h in halves]), gate_up[12:])
    fused = torch.randn(32, 16)  # q 16 rows, k 8, v 8
    parts = [c.cut("model.layers.0.self_attn.qkv_proj.weight", fused) for c in cuts]
    assert torch.equal(parts[1][:8], fused[8:16]) and torch.equal(parts[1][8:12], fused[20:24])
    # One KV head for four ranks: each rank keeps the head its queries read
    one_kv = _config(num_key_value_heads=1)
    k1 = torch.randn(4, 16)
    assert all(torch.equal(Shards(one_kv, r, 4).cut("layers.0.self_attn.v_proj.weight", k1), k1) for r in range(4))
    # The vocabulary in equal slices (64 rows over 3 ranks: 22, 22, 20 and two zero rows)
    embedding = torch.randn(64, 16)
    rows = [Shards(config, r, 3).cut("model.embed_tokens.weight", embedding) for r in range(3)]
    assert [len(r) for r in rows] == [22] * 3 and not rows[2][20:].any()
    assert torch.equal(torch.cat(rows)[:64], embedding)


def test_what_cannot_be_sharded_is_refused_by_name(folders):
    local = local_config(_config(), 2)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 6)
    assert local_config(_config(num_key_value_heads=1), 4).num_key_value_heads == 1
    with pytest.raises(ValueError, match="3 attention heads"):
        local_config(_config(num_attention_heads=3, num_key_value_heads=1), 2)
    with pytest.raises(ValueError, match="MLP of 10"):
        local_config(_config(intermediate_size=10, num_attention_heads=4), 4)
    with pytest.raises(ValueError, match="experts' MLPs of 6"):
        local_config(dataclasses.replace(_config(), moe_layers=(0,), num_experts=4, moe_intermediate_size=6), 4)
    with pytest.raises(ValueError, match="--enable-expert-parallel: .* 6 experts do not split over 4 ranks"):
        local_config(dataclasses.replace(_config(), moe_layers=(0,), num_experts=6, moe_intermediate_size=6), 4, 0)
    split = local_config(dataclasses.replace(_config(), moe_layers=(0,), num_experts=8, moe_intermediate_size=6), 4, 3)
    assert split.local_experts == (6, 2) and split.moe_intermediate_size == 6  # (whole experts: not divided)
    # Offline, before any rank starts: a hybrid's recurrent layers, and a flag not sharded yet
    with pytest.raises(ValueError, match="3 Mamba2 groups"):
        local_config(dataclasses.replace(_config(), recurrent_layers=(0,), recurrent_mixer="mamba2",
                                         mamba_num_heads=6, mamba_num_groups=3), 2)


def test_a_rank_that_cannot_meet_its_group_says_which():
    import socket

    from services.worker.parallel.group import TensorParallelGroup

    with socket.socket() as probe:  # (a port no store listens on)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RuntimeError, match=rf"rank 1 of 2 could not reach rank 0's store at 127.0.0.1:{port}"):
        TensorParallelGroup.meet(1, 2, torch.device("cpu"), port, meet_timeout_s=1)


# Each a different cut: one KV head on both ranks, q/k/v biases, GQA (4 query heads, 2 KV)
# with per-head query/key norms, a checkpoint with q/k/v and gate/up fused and an untied
# LM head over a vocabulary that does not split evenly (383 rows: 192 and 191), windows
# and soft caps with sandwich norms, and a parallel residual with biased products (o_proj's
# and down_proj's bias added once, after the sum); sparse MLPs, each rank a slice of every
# expert (Qwen2-MoE's, with its gated shared expert; GraniteMoE's stacked experts);
# latent attention (DeepSeek-V3: each rank its heads' query and kv_b_proj rows, the latent
# and its cache on every rank); gpt-oss's sinks a head and its experts' biases; Qwen3-Next's
# Gated DeltaNet (by key head, its value heads, state and convolution channels with it)
# beside gated full attention; LFM2's short convolutions (by channel); OLMo 2's query and
# key norms over every head (each rank's sum of squares added over the ranks); Mamba2 by
# head, its B and C every rank's (one group: Bamba's here, as Granite 4.0-H's; its output
# norm's sum of squares added over the ranks) or by group (Nemotron-H's two).
FAMILIES = [("llama", {"num_key_value_heads": 1}), ("qwen2", {}), ("qwen3", {}), ("phi3", {"vocab_size": 383}),
            ("gemma2", {}), ("gpt_neox", {}), ("qwen2_moe", {}), ("granite_moe", {}),
            ("deepseek_v3", {}), ("gpt_oss", {}), ("qwen3_next", {}), ("lfm2", {}),
            ("olmo2", {"num_key_value_heads": 4}), ("bamba", {"mamba_n_groups": 1}), ("nemotron_h", {})]


@pytest.mark.parametrize("arch,overrides", FAMILIES,
                         ids=[a + "".join(f"-{k}{v}" for k, v in o.items()) for a, o in FAMILIES])
def test_two_ranks_give_transformers_greedy_output(folders, arch, overrides):
    folder = folders(arch, **overrides)
    llm = LLM(str(folder), tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64)
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    assert got == hf_greedy(folder, PROMPTS, 16)
    llm.executor.close()


@pytest.mark.parametrize("arch", ["qwen2_moe", "granite_moe", "deepseek_v3", "gpt_oss"])
def test_expert_parallel_ranks_hold_whole_experts_and_give_transformers_greedy_output(folders, arch):
    """--enable-expert-parallel: each of two ranks holds half of every sparse MLP's experts,
    whole (a shared expert still sliced): Qwen2-MoE's per-expert checkpoint, GraniteMoE's
    stacked one, DeepSeek-V3's corrected router and shared experts, gpt-oss's biased
    experts (each bias added by its expert's rank alone)."""
    from services.worker.layers.moe import SparseMoE

    folder = folders(arch)
    llm = LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=256,
              num_kv_blocks=64)
    moes = [m for m in llm.runner.runner.model.modules() if isinstance(m, SparseMoE)]
    config = ModelConfig.from_folder(folder)
    assert moes and all(len(m.experts) * 2 == config.num_experts and m.expert_offset == 0 for m in moes)
    down = moes[0].experts[0].down_proj  # (its inputs whole, not a slice; packed or not)
    assert (down.in_features if hasattr(down, "in_features") else down.weight.shape[1]) == config.moe_intermediate_size
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    assert got == hf_greedy(folder, PROMPTS, 16)
    llm.executor.close()


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_two_ranks_serve_lora_adapters_as_peft_computes_them(arch, tmp_path):
    """Two adapters and the base model in one batch, each equal to PEFT's greedy output: B's
    rows cut as the base weights' (Phi-3's adapters name its fused q/k/v and gate/up), and
    o_proj's and down_proj's A by the rank's inputs, their shrunk activations summed."""
    from llmbus import LoRARequest
    from tiny_models import LORA_TARGETS_FUSED, build_lora_adapter, peft_greedy

    base = build_tiny_model(tmp_path / "base", arch=arch, seed=4)
    a1 = build_lora_adapter(base, tmp_path / "a1", seed=1,
                            target_modules=LORA_TARGETS_FUSED if arch == "phi3" else None)
    a2 = build_lora_adapter(base, tmp_path / "a2", seed=2, r=4, lora_alpha=8, use_rslora=True,
                            target_modules=["qkv_proj"] if arch == "phi3" else ["k_proj", "up_proj", "o_proj"])
    prompts = random_prompts([5, 17, 9], seed=3)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(str(base), tensor_parallel_size=2, max_model_len=256, enable_lora=True, max_loras=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            prompts * 3, greedy, lora_request=[LoRARequest("a1", 1, str(a1))] * 3 + [LoRARequest("a2", 2, str(a2))] * 3
            + [None] * 3, use_tqdm=False)]
    finally:
        llm.executor.close()
    want1, want2, want0 = peft_greedy(base, a1, prompts, 10), peft_greedy(base, a2, prompts, 10), \
        hf_greedy(base, prompts, 10)
    assert want1 != want0 and want2 != want0
    assert got == want1 + want2 + want0


def test_two_ranks_sample_what_one_rank_samples(folders):
    """Seeded draws, and a grammar's (each rank compiles its own: they sample together)."""
    from llmbus import StructuredOutputsParams

    folder = folders("llama")
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=s) for s in range(3)]
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}")))
    runs = []
    for size in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=size, max_model_len=256, num_kv_blocks=64)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs])
        llm.executor.close()
    assert runs[0] == runs[1]
    assert len({tuple(t) for t, _ in runs[0]}) == 4
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", runs[1][3][1])


def test_two_ranks_draft_with_a_draft_model_as_one_rank_does(folders):
    """A draft model under --tensor-parallel-size 2, cut as the target is: the target
    drafting for itself (every draft right where its cut and cache are right), greedy output
    transformers', the same drafts and acceptances as with one rank, seeded draws drawn
    alike on both ranks (draft_sample_method "probabilistic")."""
    folder = folders("llama")
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s) for s in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs, held = [], []
    for size in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=size, max_model_len=256, num_kv_blocks=64, speculative_config={
            "method": "draft_model", "model": str(folder), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"})
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            drawn = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
            stats = llm.stats()
            runner = rank0_runner(llm)
            held.append(sum(p.numel() for p in runner.proposer.model.parameters()))
        finally:
            llm.executor.close()
        runs.append((got, drawn, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens))
    assert held[1] < 0.75 * held[0]  # (a rank holds its cut of the draft, not all of it)
    assert runs[0] == runs[1]
    got, _, drafted, accepted = runs[1]
    assert got == hf_greedy(folder, PROMPTS, 16)
    assert drafted > 0 and accepted == drafted  # (a model drafting itself: every draft is right)


@pytest.mark.slow
def test_served_a_rank_s_death_takes_its_worker_down_and_no_stream_is_lost(folders, tmp_path):
    """`llmbus serve --tensor-parallel-size 2`: streams equal offline; the second rank
    SIGKILLed mid-stream, the worker goes down with it, the supervisor starts the group
    again and every stream ends with the undisturbed run's text."""
    from deployment import llmbus_serve, stream_texts
    from llmbus.deploy.serve import live_children

    folder = folders("llama")
    prompts = [f"stream {i}: " + "the river runs past the mill " * (2 + i % 3) for i in range(8)]
    llm = LLM(str(folder), max_model_len=512, num_kv_blocks=128)
    expected = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]
    proc, url = llmbus_serve(["--model", str(folder), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                              "--max-model-len", "512", "--num-kv-blocks", "128"], tmp_path / "serve.log")
    try:
        assert asyncio.run(stream_texts(url, prompts, 40)) == expected
        worker = live_children(proc.pid, "worker")[0]
        rank1 = [c for c in worker.children() if "services.worker.parallel.ranks" in " ".join(c.cmdline())]
        assert len(rank1) == 1
        killed = []

        def kill_rank1() -> None:
            rank1[0].kill()
            killed.append(time.monotonic())

        assert asyncio.run(stream_texts(url, prompts, 40, on_started=kill_rank1)) == expected
        assert killed
        assert [w.pid for w in live_children(proc.pid, "worker")] != [worker.pid]  # (rank 0 went with it)
        assert "tensor-parallel rank 1 exited" in (tmp_path / "serve.log").read_text()
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow
def test_served_prefill_and_decode_workers_of_two_ranks_each(folders, tmp_path):
    """`llmbus serve --prefill-workers 1 --decode-workers 1 --tensor-parallel-size 2`: each
    rank of the decode worker loads its heads of every prompt block from the prefill
    worker's rank's tier file (one host), and greedy output is transformers'."""
    import urllib.request

    import openai

    from deployment import llmbus_serve

    folder = folders("llama")
    prompts = [PROMPTS[1], PROMPTS[3]]
    proc, url = llmbus_serve([str(folder), "--served-model-name", "tiny", "--prefill-workers", "1",
                              "--decode-workers", "1", "--tensor-parallel-size", "2", "--kv-offloading-size", "0.05",
                              "--max-model-len", "512"], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = []
        for prompt in prompts:
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            got.append([int(token.removeprefix("token_id:")) for token in answer.choices[0].logprobs.tokens])
        assert got == hf_greedy(folder, prompts, 8)
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
        loaded = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("llmbus:external_prefix_cache_hits_total"))
        assert loaded == sum(map(len, prompts))  # (every prompt token loaded by the decode worker)
    finally:
        proc.terminate()
        proc.wait(60)


def test_two_ranks_hold_half_the_weights_and_match_one_rank_through_chunks_hits_and_preemption(folders):
    """Rank 0 holds about half of the model's parameter bytes (the norms whole); prompt
    logprobs within 1e-4 of one rank's in float32; and greedy output stays transformers'
    with prefills cut into chunks of 24 tokens, prompts that hit the prefix cache, and a
    pool of 12 blocks that preempts."""
    folder = folders("llama")
    shared = [PROMPTS[3] + [5, 6, 7], PROMPTS[3] + [8, 9]]  # (the second hits the first's blocks)
    logprob_params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    runs = {}
    for size in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=size, max_model_len=256, num_kv_blocks=64)
        model = (llm.runner.runner if size > 1 else llm.runner).model
        runs[size] = (sum(p.numel() * p.element_size() for p in model.parameters()),
                      [next(iter(e.values())).logprob for o in llm.generate(
                          [{"prompt_token_ids": p} for p in PROMPTS], logprob_params, use_tqdm=False)
                       for e in o.prompt_logprobs[1:]])
        if size > 1:
            llm.executor.close()
    assert 0.45 <= runs[2][0] / runs[1][0] <= 0.55, runs[2][0] / runs[1][0]
    assert max(abs(a - b) for a, b in zip(runs[1][1], runs[2][1])) < 1e-4
    llm = LLM(str(folder), tensor_parallel_size=2, max_model_len=256, num_kv_blocks=12, block_size=16,
              max_num_batched_tokens=24, enable_chunked_prefill=True)
    try:
        prompts = PROMPTS + shared
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
            use_tqdm=False)]
        stats = llm.stats()
    finally:
        llm.executor.close()
    assert got == hf_greedy(folder, prompts, 16)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
