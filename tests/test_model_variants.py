"""The loader and model cover the configs real checkpoints come in: llama3 rope scaling,
linear scaling, YaRN, Mistral-style configs, tied embeddings, sharded safetensors, bfloat16."""

import json

import pytest

import kernels.cpu as cpu_kernels
from llmbus import LLM, SamplingParams
from tiny_models import build_tiny_model, hf_greedy

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


PROMPTS = [[5, 9, 40, 77, 120, 3, 18], list(range(20, 120))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def engine_ids(folder, **kwargs):
    llm = LLM(str(folder), **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "arch, overrides",
    [
        pytest.param("llama", {"rope_parameters": {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, id="llama3-rope"),
        pytest.param("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
                     id="linear-rope"),
        # YaRN (Qwen's long-context configs, OLMo 3's): the ramp between the original and the
        # scaled frequencies, and its attention factor from the growth or as given
        pytest.param("qwen3", {"max_position_embeddings": 128, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}},
                     id="yarn-rope"),
        pytest.param("llama", {"max_position_embeddings": 128, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 8, "beta_slow": 2, "attention_factor": 1.3}}, id="yarn-rope-own-betas-and-factor"),
        pytest.param("llama", {"tie_word_embeddings": True}, id="tied-embeddings"),
        pytest.param("llama", {"attention_bias": True}, id="llama-attention-bias"),
        pytest.param("mistral", {}, id="mistral"),
        pytest.param("mistral", {"sliding_window": 24}, id="mistral-sliding-window"),  # the 100-token prompt slides
        # transformers' Qwen2: windowed from layer max_window_layers on, where use_sliding_window says
        pytest.param("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
                     id="qwen2-sliding-window"),
        pytest.param("phi3", {"sliding_window": 24}, id="phi3-sliding-window"),  # Phi-3-mini-4k's is 2047
        pytest.param("mixtral", {"sliding_window": 24}, id="mixtral-sliding-window"),
    ],
)
def test_variant_matches_transformers(tmp_path, arch, overrides):
    folder = build_tiny_model(tmp_path, arch, seed=3, **overrides)
    assert engine_ids(folder) == hf_greedy(folder, PROMPTS, 16)
    if "sliding_window" in overrides:  # windowed as transformers windows it, not capped
        config = LLM(str(folder)).runner.model_config
        assert config.layer_windows == ((0, 24) if arch == "qwen2" else (24, 24)) and config.max_model_len == 1024


@needs_cpu_kernels
def test_mistral_window_lifts_the_context_cap_and_the_fused_decode_takes_its_steps(tmp_path, monkeypatch):
    """Mistral's window is attention's, not a cap on the context; the CPU kernels' one-call
    decode layer takes every decode step, within the window and past it (its attention
    reads the window's keys); both equal transformers."""
    folder = build_tiny_model(tmp_path, "mistral", seed=3, sliding_window=40, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=256, initializer_range=0.08)
    llm = LLM(str(folder))
    assert llm.max_model_len == 1024 and llm.runner.model_config.layer_windows == (40, 40)
    fused = llm.runner.model.fused_decode
    taken = []
    takes = fused.takes
    monkeypatch.setattr(fused, "takes", lambda *a: taken.append(takes(*a)) or taken[-1])
    expected = hf_greedy(folder, PROMPTS, 16)
    for prompt, want in zip(PROMPTS, expected):  # 7 + 16 tokens fit in 40; 100 do not, and slide
        taken.clear()
        assert [o.outputs[0].token_ids for o in llm.generate([prompt], GREEDY)] == [want]
        assert taken.count(True) == 15, taken  # every decode step (the 100-token prompt's past the window)


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    folder = build_tiny_model(tmp_path, "llama", seed=4, max_shard_size="100KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert engine_ids(folder) == hf_greedy(folder, PROMPTS, 16)


def test_a_shard_cut_short_or_missing_is_named(tmp_path):
    """A partial download: the file it lacks or cuts short is named in one ValueError (what
    `llmbus serve` prints as its one line), not a safetensors traceback."""
    folder = build_tiny_model(tmp_path, "llama", seed=4, max_shard_size="100KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].write_bytes(shards[-1].read_bytes()[:2000])
    with pytest.raises(ValueError, match=f"cannot read the weights in {shards[-1]}: .*a partial download"):
        LLM(str(folder))
    shards[-1].unlink()
    with pytest.raises(ValueError, match=f"cannot read the weights in {shards[-1]}: .*No such file"):
        LLM(str(folder))


def test_bfloat16_runs_and_mostly_agrees_with_float32(tiny_llama):
    f32 = engine_ids(tiny_llama)
    bf16 = engine_ids(tiny_llama, dtype="bfloat16")
    assert all(len(ids) == 16 for ids in bf16)
    # Lower precision may flip a near-tie later on, but the first token is robust here.
    assert [ids[0] for ids in bf16] == [ids[0] for ids in f32]


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path))
