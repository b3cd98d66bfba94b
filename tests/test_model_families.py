"""Families beyond Llama and Qwen2, each token-identical to transformers on tiny random
models under every way the scheduler slices the work. Qwen3: a per-head RMSNorm on the
queries and keys before rotary (q_norm, k_norm). Phi-3: q/k/v and gate/up fused in the
checkpoint, longrope, partial rotary. Granite: embedding, residual and attention
multipliers and a logits divisor. Gemma: GeGLU, norms by 1 + w, scaled and tied
embeddings. Gemma 2: Gemma's, with norms after attention and the MLP, a sliding window
on every other layer, soft-capped scores and logits. Gemma 3: Gemma 2's without caps,
with query/key norms and the windowed layers' own rotary base. SmolLM3: layers without
rotary (NoPE) among rotating ones, tied embeddings by its config's defaults. OLMo 2: a
norm on each branch's output and none before it, query/key norms over all heads. OLMo 3:
OLMo 2's, windowed layers and a global one on YaRN with a base of its own. Mixtral and
Qwen3-MoE: sparse MLPs of 8 experts, top 2 (layers/moe.py), Qwen3-MoE with a dense last layer; GraniteMoe: Granite's scalars over
sparse layers whose experts come stacked, weighed by a softmax over the chosen logits.
OLMoE: OLMo 2's query/key norms with pre-norms, 8 experts, top 2, unnormalized.
The LayerNorm decoders: GPT-2 (learned positions, Conv1D products, gelu_new), OPT (learned
positions two rows on, queries scaled first, ReLU), GPT-NeoX (attention and MLP side by
side, q/k/v interleaved by head, partial rotary) and Phi (side by side off one norm, a
biased LM head), each with biased LayerNorms and ungated biased MLPs."""

import json
import math

import pytest
import torch
from tiny_models import build_tiny_model, causal_lm_class, hf_greedy, random_prompts

import kernels.cpu as cpu_kernels
from llmbus import LLM, SamplingParams
from services.worker.layers.moe import SparseMoE
from services.worker.models.decoder_config import ModelConfig

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts([1, 5, 16, 17, 33, 64, 100])

CASES = {  # (batch: its decode steps replayed from the graph buffers, as a GPU's CUDA graphs run them)
    "batch": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "preemption": {"num_kv_blocks": 12, "block_size": 16, "enable_prefix_caching": False},
}


def generate_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


FAMILIES = ["qwen3", "phi3", "granite", "gemma", "gemma2", "gemma3", "smollm3", "olmo2", "olmo3", "exaone4", "glm4",
            "hunyuan", "arcee", "apertus", "mixtral", "qwen3_moe", "qwen2_moe", "granite_moe",
            "gpt2", "opt", "gpt_neox", "phi", "starcoder2", "stablelm", "cohere", "cohere2", "gpt_oss", "olmoe", "glm4_moe", "dots1", "hunyuan_moe",
            "ernie4_5_moe", "minimax_m2", "deepseek_v3", "deepseek_v2", "glm4_moe_lite", "ministral3", "mistral4",
            "youtu", "internlm3", "helium", "flex_olmo", "solar_open", "exaone_moe", "jais2", "vaultgemma", "afmoe", "qwen3_5", "qwen3_5_moe",
            "qwen3_next", "lfm2", "lfm2_moe", "lfm3", "olmo_hybrid", "granite_hybrid", "granite_hybrid_dense",
            "bamba", "nemotron_h"]


def test_every_family_has_its_test_rows():
    """Each family's record names the tiny models that hold it to transformers, and each of
    them is a test row here or in the suite's other model tests."""
    from pathlib import Path

    from services.worker.models.families.registry import FAMILIES as RECORDS

    suite = " ".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    untested = {f.name: [t for t in f.tests if f'"{t}"' not in suite] for f in RECORDS}
    assert {name: rows for name, rows in untested.items() if rows} == {}
    assert {t for f in RECORDS for t in f.tests} >= set(FAMILIES)


# Seeds other than 2 where 2 puts a near-tie on a greedy path (Qwen3's: two logits 5e-7
# apart, which transformers' own cached and uncached forwards pick differently)
SEEDS = {"qwen3": 3}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from services.worker.models.families.registry import FAMILY_OF

    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=SEEDS.get(request.param, 2))
    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert request.param in FAMILY_OF[arch].tests  # (the row is the family's own)
    return folder, hf_greedy(folder, PROMPTS, MAX_NEW), request.param


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(family, case):
    folder, reference, _ = family
    llm = LLM(str(folder), **CASES[case])
    if case == "batch":
        llm.runner.set_decode_graphs("replay")
    assert generate_ids(llm, PROMPTS) == reference
    if case == "batch":
        assert llm.runner.decode_graphs.steps > 0
    if case == "preemption":
        assert llm.stats().num_preemptions > 0


def test_prefix_hits_match_transformers(family):
    folder, _, _ = family
    prefix = random_prompts([48], seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts([3, 9, 20, 1], seed=8)]
    llm = LLM(str(folder), block_size=16)
    got = generate_ids(llm, prompts[:1]) + generate_ids(llm, prompts[1:])
    assert got == hf_greedy(folder, prompts, MAX_NEW)
    # (a hybrid's too: its recurrent state is restored from the first request's snapshot
    # after its last full block, 48: services/scheduler/core/state_snapshots.py)
    assert llm.stats().prefix_cache_hits >= 3 * 48


def test_on_triton_attention_under_the_interpreter(family):
    """The GPU's kernels: attention, and for the MoE families the grouped-GEMM experts."""
    folder, reference, name = family
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)  # (a prefill step, two decode steps)
    llm = LLM(str(folder), attention_backend="triton", max_num_batched_tokens=24)
    sparse = [layer.mlp for layer in llm.runner.model.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(sparse) == {"mixtral": 2, "qwen3_moe": 1, "qwen2_moe": 1, "granite_moe": 2, "gpt_oss": 2,
                           "olmoe": 2, "glm4_moe": 1, "dots1": 1, "hunyuan_moe": 2,
                           "ernie4_5_moe": 1, "minimax_m2": 2, "deepseek_v3": 1, "deepseek_v2": 1,
                           "glm4_moe_lite": 1, "mistral4": 1, "flex_olmo": 2, "solar_open": 2, "exaone_moe": 2,
                           "afmoe": 3, "qwen3_5_moe": 4, "qwen3_next": 3,
                           "lfm2_moe": 3, "granite_hybrid": 4}.get(name, 0)
    assert all(moe.w_gate_up is not None for moe in sparse)  # stacked: fused_moe runs them
    # (transformers' first 3 greedy tokens: the first 3 of the family's reference)
    assert generate_ids(llm, prompts, params) == [ids[:3] for ids in reference[:3]]


def test_logprobs_equal_transformers(family):
    """The distribution, not only its argmax: Granite's logits divisor, which greedy output
    cannot see, is in these."""
    import torch

    folder, _, _ = family
    prompts = PROMPTS[2:5]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, ignore_eos=True)
    outputs = LLM(str(folder)).generate(prompts, params, use_tqdm=False)
    model = causal_lm_class(folder).from_pretrained(folder, dtype=torch.float32)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        want = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        got = torch.tensor([entry[token].logprob for token, entry in zip(prompt[1:], output.prompt_logprobs[1:])])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_what_each_family_reads_from_its_config(family):
    folder, _, name = family
    config = ModelConfig.from_folder(folder)  # (the model itself loads in test_matches_transformers)
    assert config.qk_norm == (name in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "olmo3", "olmoe", "exaone4", "hunyuan",
                                       "apertus", "dots1", "hunyuan_moe", "minimax_m2", "flex_olmo", "exaone_moe",
                                       "afmoe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe", "lfm3",
                                       "olmo_hybrid"))
    # Hunyuan: its norms after rotary, the base raised by alpha 50 ** (16 / 14)
    assert config.qk_norm_after_rope == (name in ("hunyuan", "hunyuan_moe"))
    if name in ("hunyuan", "hunyuan_moe"):
        assert (config.rope_theta, config.rope_scaling) == (pytest.approx(1e4 * 50 ** (16 / 14)), {"rope_type": "default"})
    assert (config.qk_norm_over_heads, config.pre_norms) == ((True, True) if name in ("olmoe", "minimax_m2", "olmo_hybrid") else
                                                             (True, False) if "olmo" in name else
                                                             (False, False) if name == "exaone4" else (False, True))
    assert config.moe_layers == {"mixtral": (0, 1), "qwen3_moe": (0,), "qwen2_moe": (0,), "granite_moe": (0, 1),
                                 "gpt_oss": (0, 1), "olmoe": (0, 1), "glm4_moe": (1,), "dots1": (1,),
                                 "hunyuan_moe": (0, 1), "ernie4_5_moe": (1,), "minimax_m2": (0, 1),
                                 "deepseek_v3": (1,), "deepseek_v2": (1,), "glm4_moe_lite": (0,),
                                 "mistral4": (1,), "flex_olmo": (0, 1), "solar_open": (0, 1),
                                 "exaone_moe": (1, 3), "afmoe": (1, 2, 3), "qwen3_5_moe": (0, 1, 2, 3),
                                 "qwen3_next": (0, 2, 3), "lfm2_moe": (1, 2, 3),
                                 "granite_hybrid": (0, 1, 2, 3)}.get(name, ())
    assert config.norm_topk_prob == (name in ("mixtral", "qwen3_moe", "granite_moe", "gpt_oss", "glm4_moe", "hunyuan_moe",
                                                 "ernie4_5_moe", "minimax_m2", "deepseek_v3", "glm4_moe_lite",
                                                 "mistral4", "solar_open", "exaone_moe", "afmoe", "qwen3_5_moe",
                                                 "qwen3_next", "lfm2_moe", "granite_hybrid"))  # (OLMoE's, FlexOlmo's: off)
    assert config.shared_expert_intermediate_size == {"qwen2_moe": 64, "glm4_moe": 64, "dots1": 32,
                                                          "hunyuan_moe": 64, "ernie4_5_moe": 32,
                                                          "deepseek_v3": 32, "deepseek_v2": 64, "glm4_moe_lite": 32,
                                                          "mistral4": 32, "solar_open": 32, "exaone_moe": 32,
                                                          "afmoe": 32, "qwen3_5_moe": 64,
                                                          "qwen3_next": 64, "granite_hybrid": 64}.get(name, 0)  # (GLM's: 2 of 32)
    # GLM-4.5 and dots.llm1: DeepSeek-V3's router (4 groups, the best 2 kept, scaled), the
    # shared experts unweighed; GLM's multi-token-prediction layer skipped
    assert (config.moe_score_correction, config.moe_num_groups, config.moe_topk_groups, config.routed_scaling_factor,
            config.shared_expert_gated, config.skipped_layers) == {
        "glm4_moe": ("sigmoid", 4, 2, 2.5, False, 1), "dots1": ("sigmoid", 4, 2, 1.5, False, 0),
        "deepseek_v3": ("sigmoid", 4, 2, 2.5, False, 1), "deepseek_v2": ("softmax", 4, 2, 1.5, False, 0),
        "glm4_moe_lite": ("sigmoid", 4, 2, 1.8, False, 1), "mistral4": ("softmax", 4, 2, 1.5, False, 0),
        "solar_open": ("sigmoid", 4, 2, 2.5, False, 0), "exaone_moe": ("sigmoid", 4, 2, 2.5, False, 0),
        "afmoe": ("sigmoid", 1, 1, 2.5, False, 0), "lfm2_moe": ("sigmoid", 1, 1, 2.5, True, 0),
        "granite_hybrid": ("", 1, 1, 1.0, False, 0),
        "hunyuan_moe": ("", 1, 1, 1.0, False, 0),
        "ernie4_5_moe": ("softmax", 1, 1, 1.0, False, 0),
        "minimax_m2": ("sigmoid", 1, 1, 1.0, True, 0)}.get(name, ("", 1, 1, 1.0, True, 0))
    assert config.moe_topk_softmax == (name in ("granite_moe", "gpt_oss", "granite_hybrid"))
    # gpt-oss: biased router and experts, their clamped SwiGLU, and the attention's sinks
    assert (config.attention_sinks, config.moe_bias, config.swiglu_alpha, config.swiglu_limit) == (
        (True, True, 1.702, 1.0) if name == "gpt_oss" else (False, False, 0.0, 0.0))
    assert config.nope_layers == {"smollm3": (1,), "exaone4": (3,), "exaone_moe": (3,), "afmoe": (3,), "cohere2": (3,),
                                  "gpt2": (0, 1),
                                  "opt": (0, 1), "granite_hybrid": (0, 1, 2, 3),
                                  "granite_hybrid_dense": (0, 1, 2, 3),
                                  "nemotron_h": (0, 1, 2, 3, 4, 5)}.get(name, ())  # (EXAONE's and Cohere 2's global layer)
    # 0.8 / sqrt(16); sqrt(64); Gemma 2's and 3's scale from query_pre_attn_scalar 24, not head_dim 16
    scalars = {"granite": (3.0, 0.6, 0.2, 2.5), "granite_moe": (3.0, 0.6, 0.2, 2.5),
               "granite_hybrid": (3.0, 0.6, 0.2, 2.5), "granite_hybrid_dense": (3.0, 0.6, 0.2, 2.5), "gemma": (8.0, 1.0, None, 1.0), "gemma2": (8.0, 1.0, 24**-0.5, 1.0),
               "vaultgemma": (8.0, 1.0, 24**-0.5, 1.0), "afmoe": (8.0, 1.0, None, 1.0),  # (muP: sqrt(64))
               "gemma3": (8.0, 1.0, 24**-0.5, 1.0), "cohere": (1.0, 1.0, None, 2.0),
               "cohere2": (1.0, 1.0, None, 2.0),  # (Cohere's logit_scale 0.5)
               # DeepSeek-V3: 1/sqrt(16 + 8) times YaRN's mscale of mscale_all_dim 0.7 at factor 4, squared
               "deepseek_v3": (1.0, 1.0, pytest.approx(24**-0.5 * (0.07 * math.log(4) + 1) ** 2), 1.0),
               "deepseek_v2": (1.0, 1.0, pytest.approx(24**-0.5), 1.0),  # (no YaRN)
               "glm4_moe_lite": (1.0, 1.0, pytest.approx(24**-0.5), 1.0),
               "mistral4": (1.0, 1.0, pytest.approx(24**-0.5 * (0.1 * math.log(4) + 1) ** 2), 1.0),
               "youtu": (1.0, 1.0, pytest.approx(24**-0.5), 1.0)}
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_scale,
            config.logits_scaling) == scalars.get(name, (1.0, 1.0, None, 1.0))
    assert (config.hidden_act, config.norm_weight_offset, config.tie_word_embeddings) == {
        "gemma": ("gelu_pytorch_tanh", 1.0, True), "gemma2": ("gelu_pytorch_tanh", 1.0, False),
        "vaultgemma": ("gelu_pytorch_tanh", 1.0, False),
        "gemma3": ("gelu_pytorch_tanh", 1.0, False), "smollm3": ("silu", 0.0, True),
        "arcee": ("relu2", 0.0, False), "apertus": ("xielu", 0.0, False), "gpt2": ("gelu_new", 0.0, True),
        "opt": ("relu", 0.0, True), "gpt_neox": ("gelu", 0.0, False), "phi": ("gelu_new", 0.0, False),
        "starcoder2": ("gelu_pytorch_tanh", 0.0, True), "cohere": ("silu", 0.0, True), "cohere2": ("silu", 0.0, True),
        "youtu": ("silu", 0.0, True), "jais2": ("relu2", 0.0, False), "nemotron_h": ("relu2", 0.0, False), "qwen3_5": ("silu", 1.0, False),
        "qwen3_5_moe": ("silu", 1.0, False), "qwen3_next": ("silu", 1.0, False),
    }.get(name, ("silu", 0.0, False))
    # (Arcee's MLP: down(relu(up x) ** 2); the LayerNorm decoders' down(act(up x)))
    assert config.gated_mlp == (name not in ("arcee", "apertus", "gpt2", "opt", "gpt_neox", "phi", "starcoder2", "jais2",
                                             "nemotron_h"))
    # The LayerNorm decoders: GPT-2's and OPT's learned positions (OPT's two rows on), no layer
    # rotating; NeoX's and Phi's branches side by side, Phi's off one norm; Phi's biased head;
    # OPT's queries scaled as they are projected
    assert (config.layer_norm, config.norm_bias, config.parallel_residual, config.shared_norm,
            config.position_embeddings, config.position_offset, config.lm_head_bias, config.scale_queries) == {
        "gpt2": (True, True, False, False, 1024, 0, False, False),
        "opt": (True, True, False, False, 1026, 2, False, True),
        "gpt_neox": (True, True, True, False, 0, 0, False, False),
        "phi": (True, True, True, True, 0, 0, True, False),
        "starcoder2": (True, True, False, False, 0, 0, False, False),
        "jais2": (True, True, False, False, 0, 0, False, False),
        "stablelm": (True, True, False, False, 0, 0, False, False),
        "cohere": (True, False, True, True, 0, 0, False, False),
        "cohere2": (True, False, True, True, 0, 0, False, False),
    }.get(name, (False, False, False, False, 0, 0, False, False))
    assert config.residual_first == (name in ("cohere", "cohere2"))  # (StableLM's too, where it is parallel)
    if name in ("gpt2", "opt"):
        assert config.nope_layers == (0, 1)
    if name in ("gpt_neox", "phi"):
        assert config.rotary_dim == 8 and config.mlp_bias
    assert (config.layer_windows, config.attn_logit_softcapping, config.final_logit_softcapping,
            config.sandwich_norms, config.sliding_window, config.local_rope_theta) == {
        "gemma2": ((24, 0, 24), 5.0, 10.0, True, None, None),
        "vaultgemma": ((24, 0), 5.0, 10.0, False, None, None),
        "gemma3": ((24, 0, 24), None, None, True, None, 10000.0),
        "olmo2": ((), None, None, True, None, None), "flex_olmo": ((), None, None, True, None, None),
        "glm4": ((), None, None, True, None, None),
        "exaone4": ((24, 24, 24, 0), None, None, True, None, None),
        "exaone_moe": ((24, 24, 24, 0), None, None, False, None, None),
        "afmoe": ((24, 24, 24, 0), None, None, True, None, None),
        "olmo3": ((24, 0), None, None, True, None, 10000.0),
        "gpt_oss": ((24, 0), None, None, False, None, None),
        "starcoder2": ((24, 24), None, None, False, None, None),
        "cohere2": ((24, 24, 24, 0), None, None, False, None, None),
        "dots1": ((0, 24), None, None, False, None, None),
        "lfm3": ((0, 8, 0, 0), None, None, True, None, 10000.0)}.get(name, ((), None, None, False, None, None))
    if name == "gemma3":  # the global layer's rope, as any family's
        assert (config.rope_theta, config.rope_scaling) == (100.0, {"rope_type": "linear", "factor": 2.0})
    if name == "olmo3":  # its YaRN on the global layer alone
        assert (config.rope_theta, config.rope_scaling["rope_type"]) == (500.0, "yarn")
    assert (config.num_experts, config.num_experts_per_tok) == (
        (8, 2) if "moe" in name or name in ("mixtral", "gpt_oss", "dots1", "minimax_m2", "deepseek_v3", "deepseek_v2",
                                            "mistral4", "solar_open", "exaone_moe", "afmoe", "qwen3_next",
                                            "granite_hybrid")
        else (7, 5) if name == "flex_olmo" else (0, 0))
    hybrid = name in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    # OLMo Hybrid: three Gated DeltaNet layers (2 heads of 16, values 32 wide, beta times 2,
    # its output norm's eps 1e-5) normed as a Llama's, then attention normed as OLMo 2's
    assert (config.linear_beta_scale, config.linear_norm_eps, config.post_normed_layers) == (
        (2.0, 1e-5, (3,)) if name == "olmo_hybrid" else (1.0, 0.0, ()))
    if name == "olmo_hybrid":
        assert (config.recurrent_layers, config.recurrent_mixer, config.linear_num_key_heads,
                config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim,
                config.linear_conv_kernel_dim, config.attention_layers, config.attention_gate,
                config.norm_weight_offset) == ((0, 1, 2), "gated_delta_net", 2, 2, 16, 32, 4, (3,), False, 0.0)
    assert config.attention_gate == (name in ("afmoe", "lfm3") or hybrid)  # (AFMoE's, Qwen3.5's, LFM3's gated output)
    # Qwen3.5's hybrid: three Gated DeltaNet layers, then full attention (a quarter of each head rotating)
    assert (config.recurrent_layers, config.linear_num_key_heads, config.linear_num_value_heads,
            config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim) == (
        ((0, 1, 2), 2, 4, 16, 16, 4) if hybrid else ((0, 1, 2), 2, 2, 16, 32, 4) if name == "olmo_hybrid" else
        ((0, 1, 3) if "lfm2" in name or "granite_hybrid" in name or name == "bamba" else
         (0, 3) if name == "lfm3" else (0, 2, 5) if name == "nemotron_h" else (), 0, 0, 0, 0, 0))
    # Granite 4.0-H's Mamba2: 8 heads of 16 over a state of 16, 2 groups, 4 wide (its MLP
    # the shared one's 64 where it has no experts)
    assert (config.recurrent_mixer, config.mamba_num_heads, config.mamba_head_dim, config.mamba_state_size,
            config.mamba_num_groups, config.mamba_conv_kernel, config.mamba_conv_bias, config.mamba_dt_limit) == (
        ("mamba2", 8, 16, 16, 2, 4, True, (0.0, math.inf)) if "granite_hybrid" in name or name in ("bamba", "nemotron_h") else
        ("gated_delta_net" if hybrid or name == "olmo_hybrid" else "short_conv" if "lfm" in name else "", 0, 0, 0, 1, 0,
         True, (0.0, math.inf)))
    if name == "granite_hybrid_dense":
        assert config.intermediate_size == 64
    if name == "bamba":  # (its attention rotating half of each head)
        assert (config.attention_layers, config.rotary_dim) == ((2,), 8)
    # Nemotron-H's blocks of one branch, "M-M*-M": its MLP blocks 1 and 4, attention 3
    assert (config.mixerless_layers, config.mlpless_layers) == (
        ((1, 4), (0, 2, 3, 5)) if name == "nemotron_h" else ((), ()))
    if name == "nemotron_h":
        assert (config.attention_layers, config.num_hidden_layers, config.rms_norm_eps) == ((3,), 6, 1e-5)
    if hybrid:
        assert (config.attention_layers, config.rotary_dim) == ((3,), 4)
    # LFM2's: short convolutions 3 wide on layers 0, 1 and 3, its MLP from intermediate_size 200
    assert (config.recurrent_layers, config.short_conv_kernel, config.short_conv_bias) == (
        ((0, 1, 3), 3, False) if name in ("lfm2", "lfm2_moe") else ((0, 3), 7, False) if name == "lfm3"
        else (config.recurrent_layers, 0, False))
    if name == "lfm2":
        assert (config.attention_layers, config.intermediate_size, config.rms_norm_eps) == ((2,), 224, 1e-5)
    # LFM3's: convolutions 7 wide on 0 and 3, layer 1 sliding (8, the default rope's base
    # 1e4), layer 2 full (proportional rope, base 100: all 16 dims, 4 of 8 frequencies not zero), four
    # norms a layer
    if name == "lfm3":
        assert (config.recurrent_layers, config.short_conv_kernel, config.attention_layers, config.layer_windows,
                config.local_rope_theta, config.rope_theta, config.rotary_dim, config.rope_scaling,
                config.sandwich_norms) == ((0, 3), 7, (1, 2), (0, 8, 0, 0), 1e4, 100.0, 0,
                                           {"rope_type": "proportional", "partial_rotary_factor": 0.5}, True)
    # DeepSeek-V2's router: softmax scores alone, a group ranked by its best expert
    assert (config.moe_correction_bias, config.moe_group_by_max) == {"deepseek_v2": (False, True),
                                                                     "mistral4": (False, False)}.get(name, (True, False))
    # Ministral 3's and Mistral 4's queries scaled past the pretrained context (beta 0.5, 16)
    assert (config.query_scale_beta, config.query_scale_original) == (
        (0.5, 16) if name in ("ministral3", "mistral4") else (0.0, 0))
    # DeepSeek-V3's latent attention: the cache's one head of the latent (32) and the rotating key (8)
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim, config.head_dim, config.num_key_value_heads, config.rotary_head_dim) == (
        (32, 32, 16, 8, 16, 40, 1, 8) if name == "deepseek_v3" else (32, 0, 16, 8, 16, 40, 1, 8) if name == "deepseek_v2"
        else (32, 32, 16, 8, 24, 40, 1, 8) if name == "glm4_moe_lite"
        else (32, 32, 16, 8, 16, 40, 1, 8) if name in ("mistral4", "youtu")
        else (0, 0, 0, 0, 0, config.head_dim,
                                                                     config.num_key_value_heads, config.head_dim))
    # GLM: half of each head of 16 rotating, by interleaved pairs; q/k/v biases but none on o_proj
    assert (config.rotary_interleaved, config.rotary_dim, config.o_bias) == {
        "glm4": (True, 8, False), "cohere": (True, 0, False), "cohere2": (True, 0, False), "stablelm": (False, 4, False),
        "glm4_moe": (False, 8, False), "ernie4_5_moe": (True, 0, False), "deepseek_v3": (True, 0, False),
        "deepseek_v2": (True, 0, False), "glm4_moe_lite": (True, 0, False), "mistral4": (True, 0, False),
        "youtu": (True, 0, False), "internlm3": (False, 0, True), "helium": (True, 0, False)}.get(
        name, (False, config.rotary_dim, config.o_bias))
    assert config.qkv_bias == (name in ("glm4", "qwen2_moe", "gpt2", "opt", "gpt_neox", "phi", "gpt_oss", "starcoder2",
                                        "stablelm", "glm4_moe", "internlm3", "helium", "solar_open", "jais2"))
    if name == "internlm3":  # (its MLP biased too; its dynamic NTK rope the default frequencies here)
        assert config.mlp_bias and config.rope_scaling == {"rope_type": "default"} and config.rope_theta == 50000.0


@pytest.mark.parametrize("arch, overrides", [("glm4_moe", {"use_qk_norm": True}), ("glm4_moe_lite", {})])
def test_glm4_moe_skips_its_multi_token_prediction_layer(tmp_path, arch, overrides):
    """GLM-4.5's checkpoints hold a multi-token-prediction layer past the last one (a decoder
    layer and more): skipped where the config counts it (num_nextn_predict_layers), as
    transformers skips it, and named where it does not. With query/key norms (use_qk_norm).
    GLM-4.7-Flash's config leaves the count out (transformers' class has no such field and
    skips its layer by name): one is skipped."""
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / arch, arch, seed=3, **overrides)
    assert ("num_nextn_predict_layers" in json.loads((folder / "config.json").read_text())) == (arch == "glm4_moe")
    reference = hf_greedy(folder, PROMPTS, MAX_NEW)
    weights = load_file(folder / "model.safetensors")
    assert not any(n.startswith("model.layers.2.") for n in weights)
    for name in [n for n in weights if n.startswith("model.layers.1.")]:
        weights[name.replace("model.layers.1.", "model.layers.2.")] = torch.randn_like(weights[name])
    weights["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(folder))
    assert llm.runner.model_config.qk_norm == (arch == "glm4_moe")
    assert generate_ids(llm, PROMPTS) == reference
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.2."):
        LLM(str(folder))


@pytest.mark.parametrize("arch, router_dtype", [("ernie4_5_moe", torch.float32), ("glm4_moe", torch.bfloat16)])
def test_corrected_routers_keep_float32_where_transformers_does(tmp_path, arch, router_dtype):
    """In bfloat16, a corrected router's bias stays float32 (every family's class keeps it
    so) and ERNIE's weights too (its class keeps `gate.weight` float32); GLM's take the
    model's dtype, as transformers casts them."""
    llm = LLM(str(build_tiny_model(tmp_path / arch, arch, seed=2)), dtype="bfloat16")
    moe = next(layer.mlp for layer in llm.runner.model.model.layers if isinstance(layer.mlp, SparseMoE))
    assert (moe.gate.weight.dtype, moe.gate.e_score_correction_bias.dtype) == (router_dtype, torch.float32)


def test_hunyuan_moe_router_keeps_float32_in_bfloat16(tmp_path):
    """As transformers' HunYuanMoEV1Gate keeps `wg` (tests/test_moe_routers.py: the routing
    itself), while the experts take the model's dtype."""
    llm = LLM(str(build_tiny_model(tmp_path / "hunyuan_moe", "hunyuan_moe", seed=2)), dtype="bfloat16")
    moe = next(layer.mlp for layer in llm.runner.model.model.layers if isinstance(layer.mlp, SparseMoE))
    down = moe.shared_expert.down_proj  # (a PackedLinear where the CPU kernels load, else an nn.Linear)
    assert (moe.gate.weight.dtype, getattr(down, "dtype", None) or down.weight.dtype) == (torch.float32, torch.bfloat16)


def test_deepseek_v3_with_one_query_projection_and_a_latent_head_of_64_matches_transformers(tmp_path):
    """DeepSeek-V2-Lite's queries (q_lora_rank None: one q_proj, not a third of a fused
    qkv_proj), rotating by halves (rope_interleave false: no rows reordered); a latent head
    56 + 8 = 64 wide, the width the fused C decode layer takes for ordinary heads, which
    must still step aside for latent attention."""
    folder = build_tiny_model(tmp_path / "ds", "deepseek_v3", seed=2, q_lora_rank=None, kv_lora_rank=56,
                              rope_interleave=False,
                              first_k_dense_replace=2)  # (every layer dense: the C layer takes no experts)
    llm = LLM(str(folder))
    assert llm.runner.model.fused_decode is None and llm.runner.model_config.head_dim == 64
    assert llm.runner.model.model.layers[0].self_attn.q_proj is not None
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_latent_attention_caches_one_latent_a_token_for_its_keys_and_values(tmp_path, backend):
    """The cache's K and V of a latent-attention layer are one memory (the latent is both),
    so a budget holds twice the blocks it would for two halves: 40 values a token a layer."""
    folder = build_tiny_model(tmp_path / "ds", "deepseek_v3", seed=2)
    llm = LLM(str(folder), kv_cache_memory_bytes=1 << 20, block_size=16, attention_backend=backend)
    assert llm.runner.num_blocks == (1 << 20) // (2 * 16 * 40 * 4)  # (2 layers, float32)
    cache = llm.runner.kv_caches[0]
    assert cache[0].data_ptr() == cache[1].data_ptr() and cache.stride(0) == 0


@needs_cpu_kernels
def test_ministral3_one_call_decode_layer_steps_aside_past_the_pretrained_context(tmp_path):
    """The C decode layer knows nothing of Llama 4's temperature: it takes a step only while
    every position is within original_max_position_embeddings (16 here), where the scale is
    exactly 1; the prompts and their outputs cross it, and greedy still equals transformers."""
    folder = build_tiny_model(tmp_path / "m3", "ministral3", seed=2, hidden_size=256, head_dim=64,
                              intermediate_size=256, initializer_range=0.08)
    llm = LLM(str(folder))
    assert llm.runner.model.fused_decode is not None and llm.runner.model_config.query_scale_original == 16
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


def test_internlm3_config_as_its_checkpoints_write_it(tmp_path):
    """internlm3-8b-instruct's config.json names its biases qkv_bias and bias (transformers'
    attribute map) and its rope in the older rope_scaling, dynamic NTK of factor 6."""
    folder = build_tiny_model(tmp_path / "i3", "internlm3", seed=2)
    reference = hf_greedy(folder, PROMPTS, MAX_NEW)
    config = json.loads((folder / "config.json").read_text())
    for ours, theirs in (("attention_bias", "qkv_bias"), ("mlp_bias", "bias")):
        config[theirs] = config.pop(ours)
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = {"type": "dynamic", "factor": 6.0}
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder))
    config = llm.runner.model_config
    assert config.architecture == "InternLM3ForCausalLM" and config.qkv_bias and config.mlp_bias
    assert generate_ids(llm, PROMPTS) == reference


def test_exaone_moe_leaves_its_multi_token_prediction_module_unread(tmp_path):
    """K-EXAONE's checkpoints hold an mtp.* module beside the model, which transformers
    leaves unread: so does llmbus (any other stray tensor is still named)."""
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "em", "exaone_moe", seed=2)
    reference = hf_greedy(folder, PROMPTS, MAX_NEW)
    weights = load_file(folder / "model.safetensors")
    weights["mtp.layers.0.eh_proj.weight"] = torch.randn(64, 128)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert generate_ids(LLM(str(folder)), PROMPTS) == reference
    weights["stray.weight"] = torch.randn(4)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight 'model.stray.weight'"):
        LLM(str(folder))


@needs_cpu_kernels
def test_vaultgemma_on_the_one_call_decode_layer_matches_transformers(tmp_path):
    """Gemma 2's attention and norms without its output norms: a plain pre-norm layer the
    C decode layer takes (heads of 64), its caps and windows with it."""
    folder = build_tiny_model(tmp_path / "vg", "vaultgemma", seed=2, hidden_size=256, head_dim=64,
                              intermediate_size=256, initializer_range=0.08)
    llm = LLM(str(folder))
    assert llm.runner.model.fused_decode is not None and not llm.runner.model_config.sandwich_norms
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


def test_latent_attention_refuses_lora_by_name(tmp_path):
    folder = build_tiny_model(tmp_path / "ds", "deepseek_v3", seed=2)
    with pytest.raises(ValueError, match="--enable-lora is not supported for DeepseekV3ForCausalLM"):
        LLM(str(folder), enable_lora=True)


def test_glm_matches_transformers(tmp_path):
    """GLM-4's first layer (glm-4-9b-chat-hf: GlmForCausalLM), without GLM-4-0414's four
    norms (the families' glm4): interleaved half-rotary, q/k/v biases, gate/up fused."""
    folder = build_tiny_model(tmp_path / "glm", "glm", seed=2)
    assert generate_ids(LLM(str(folder)), PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("arch, overrides", [("ernie4_5", {}), ("ernie4_5", {"use_bias": True}),
                                             ("llama", {"mlp_bias": True, "attention_bias": True}),
                                             ("seed_oss", {}), ("seed_oss", {"attention_out_bias": True,
                                                                             "mlp_bias": True})])
def test_ernie4_5_seed_oss_and_biased_mlps_match_transformers(tmp_path, arch, overrides):
    """ERNIE 4.5 (dense): interleaved rotary as GLM's, reordered at load; its use_bias and
    Llama's and Seed-OSS's mlp_bias bias the MLP's projections too (gate/up and down);
    Seed-OSS biases q/k/v by default and o_proj where attention_out_bias says."""
    folder = build_tiny_model(tmp_path / arch, arch, seed=2, **overrides)
    llm = LLM(str(folder))
    config = llm.runner.model_config
    assert (config.rotary_interleaved, config.mlp_bias) == (arch == "ernie4_5", bool(overrides))
    if arch == "seed_oss":
        assert (config.qkv_bias, config.o_bias) == (True, bool(overrides))
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


def test_a_weight_the_config_does_not_announce_is_named(tmp_path):
    """A q/k/v bias where the config says none (a packed module's shard) is named as any
    unexpected weight is, not a KeyError."""
    folder = build_tiny_model(tmp_path / "m", "llama", seed=2, attention_bias=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.[kqv]_proj\.bias'"):
        LLM(str(folder))


def test_qwen3_moe_unnormalized_router_and_sparse_step_match_transformers(tmp_path):
    """norm_topk_prob off (the top-k weighed by their share of the whole softmax) and
    decoder_sparse_step 2 (every second layer sparse, the others dense)."""
    folder = build_tiny_model(tmp_path / "m", "qwen3_moe", seed=3, num_hidden_layers=4, norm_topk_prob=False,
                              decoder_sparse_step=2, mlp_only_layers=[])
    llm = LLM(str(folder))
    assert llm.runner.model_config.moe_layers == (1, 3) and not llm.runner.model_config.norm_topk_prob
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


def test_a_smollm3_config_is_read_with_its_own_defaults(tmp_path):
    """What SmolLM3's config.json may leave out is SmolLM3's default, not a Llama's: tied
    embeddings, a rotary base of 2e6, a NoPE layer every fourth (transformers reads the
    same folder the same way, so greedy output still equals its)."""
    folder = build_tiny_model(tmp_path / "m", "smollm3", seed=2, num_hidden_layers=4)
    config = json.loads((folder / "config.json").read_text())
    for key in ("tie_word_embeddings", "rope_parameters", "no_rope_layers", "no_rope_layer_interval"):
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder))
    read = llm.runner.model_config
    assert (read.tie_word_embeddings, read.rope_theta, read.nope_layers) == (True, 2e6, (3,))
    assert generate_ids(llm, PROMPTS[:3]) == hf_greedy(folder, PROMPTS[:3], MAX_NEW)


def test_a_config_the_loader_would_mishandle_is_refused_by_name(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "mixtral", seed=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be within 1..8"):
        LLM(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["JambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture .*JambaForCausalLM"):
        LLM(str(folder))
    # A supported architecture whose config does not read as its transformers class does
    # (Mixtral's file labelled Qwen3-Next: no head_dim where that class needs one)
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3NextForCausalLM"],
                                                    "head_dim": None}))
    with pytest.raises(ValueError, match="config.json does not read as transformers' qwen3_next config"):
        LLM(str(folder))



@pytest.mark.parametrize("arch, change, why", [
    ("ernie4_5_moe", {"use_bias": True}, "unsupported use_bias true for ERNIE 4.5 MoE"),
    ("hunyuan_moe", {"moe_topk": [2, 1]}, r"unsupported moe_topk \[2, 1\]: one value for every layer only"),
    ("glm4_moe", {"n_group": 3}, "n_group 3 and topk_group 2 must split 8 experts"),
    ("deepseek_v3", {"attention_bias": True}, "unsupported attention_bias true for DeepseekV3ForCausalLM"),
    ("deepseek_v3", {"qk_rope_head_dim": 7}, "unsupported latent attention dims"),
    ("deepseek_v2", {"norm_topk_prob": True}, "unsupported norm_topk_prob true for DeepSeek-V2"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "unsupported topk_method 'noaux_tc' for DeepSeek-V2"),
    ("hunyuan_moe", {"architectures": ["HunYuanMoEV1ForSequenceClassification"]},
     "the HunYuanMoEV1ForCausalLM family generates; its ForSequenceClassification is not served"),
])
def test_a_moe_config_the_loader_would_mishandle_is_refused_by_name(tmp_path, arch, change, why):
    folder = build_tiny_model(tmp_path / "m", arch, seed=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=why):
        LLM(str(folder))


def test_a_gemma2_config_the_loader_would_mishandle_is_refused_by_name(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "gemma2", seed=2)
    config = json.loads((folder / "config.json").read_text())
    for change, message in [({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
                             "layer_types must name sliding_attention or full_attention for each of 3 layers"),
                            ({"layer_types": ["full_attention"]}, "for each of 3 layers"),
                            ({"attn_logit_softcapping": 0}, "attn_logit_softcapping 0 must be positive"),
                            ({"sliding_window": 0}, "sliding_window 0 must be at least 1")]:
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            LLM(str(folder))


def test_gemma3_config_as_its_checkpoints_ship_it_reads_as_transformers_5_writes_it(tmp_path):
    """gemma-3-1b's config.json predates rope_parameters by layer type: rope_theta and
    rope_scaling are the global layers', rope_local_base_freq the windowed ones', and
    sliding_window_pattern says which layers slide (here 2: layers 0 and 2, as the new
    format's layer_types). Read either way, the same config, and transformers' tokens."""
    folder = build_tiny_model(tmp_path / "m", "gemma3", seed=2)
    new = LLM(str(folder)).runner.model_config
    config = json.loads((folder / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del config[key]
    config.update(rope_theta=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=10000.0,
                  sliding_window_pattern=2)
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder))
    assert llm.runner.model_config == new
    assert generate_ids(llm, PROMPTS[4:]) == hf_greedy(folder, PROMPTS[4:], MAX_NEW)
    (folder / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        LLM(str(folder))


def test_gemma3_windowed_layers_take_the_plain_path_while_the_window_holds_every_key(tmp_path, monkeypatch):
    """A step whose sequences all fit in the window attends as if unwindowed (the CPU
    kernels' path); past the window the windowed loop runs, and both equal transformers."""
    from services.worker.attention import torch_backend

    folder = build_tiny_model(tmp_path / "m", "gemma3", seed=2)
    calls = []
    windowed = torch_backend.capped_or_windowed
    monkeypatch.setattr(torch_backend, "capped_or_windowed", lambda *a, **kw: calls.append(a[4]) or windowed(*a, **kw))
    llm = LLM(str(folder))
    short, long = PROMPTS[:2], PROMPTS[5:]  # 1 and 5 tokens + 8 new stay under 24; 64 and 100 do not
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert generate_ids(llm, short, params) == hf_greedy(folder, short, 8) and calls == []
    assert generate_ids(llm, long, params) == hf_greedy(folder, long, 8) and set(calls) == {24}


def test_gemma3_multimodal_checkpoint_serves_its_language_model_and_reads_the_vision_tower_apart(tmp_path):
    """gemma-3-4b/12b/27b-it ship as Gemma3ForConditionalGeneration: text_config and
    language_model.* weights beside a vision tower. Their language model serves text as
    the text-only checkpoint's would, equal to transformers' multimodal model on text; the
    tower is the image encoder's (tests/test_images.py), not the decoder's."""
    import dataclasses

    from safetensors import safe_open

    from services.worker.loader import iter_weights

    folder = build_tiny_model(tmp_path / "mm", "gemma3_multimodal", seed=2)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert any(name.startswith("vision_tower.") for name in f.keys())
    assert not any("vision" in name or "projector" in name for name, _ in iter_weights(folder))
    llm = LLM(str(folder))
    text_only = build_tiny_model(tmp_path / "text", "gemma3", seed=2)
    # (the same but for the 3 image tokens its tokenizer adds)
    assert llm.runner.model_config == dataclasses.replace(LLM(str(text_only)).runner.model_config, vocab_size=387)
    assert llm.runner.images is not None
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("arch, text_model", [("mistral3_multimodal", "MistralForCausalLM"),
                                              ("ministral3_multimodal", "Ministral3ForCausalLM")])
def test_mistral3_multimodal_checkpoint_serves_its_language_model(tmp_path, arch, text_model):
    """Mistral Small 3.1/3.2 ship as Mistral3ForConditionalGeneration (Pixtral's vision tower
    beside a Mistral), Ministral 3 too (beside a Ministral 3): its language model serves
    text, equal to transformers' multimodal model on text, the tower unread; a text
    model_type it does not know is refused by name."""
    from transformers import Mistral3ForConditionalGeneration

    from services.worker.loader import iter_weights

    folder = build_tiny_model(tmp_path / "mm", arch, seed=2)
    assert not any("vision" in name or "projector" in name for name, _ in iter_weights(folder))
    llm = LLM(str(folder))
    assert llm.runner.model_config.architecture == text_model
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW,
                                                   model_class=Mistral3ForConditionalGeneration)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "text_config": {**config["text_config"],
                                                                               "model_type": "qwen2"}}))
    with pytest.raises(ValueError, match="unsupported text_config model_type 'qwen2'"):
        LLM(str(folder))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_vl_checkpoint_serves_its_language_model(tmp_path, arch):
    """Qwen2.5-VL and Qwen3-VL (Qwen2-VL alike): a Qwen2 (Qwen3) behind a vision tower, its
    rotary MRoPE, which on text (a token's three positions all its index) is the ordinary
    rotary; equal to transformers' multimodal model on text, the tower unread."""
    import transformers

    from services.worker.loader import iter_weights

    folder = build_tiny_model(tmp_path / "mm", arch, seed=2)
    assert not any("visual" in name for name, _ in iter_weights(folder))
    llm = LLM(str(folder))
    assert llm.runner.model_config.architecture == ("Qwen2ForCausalLM" if arch == "qwen2_5_vl" else "Qwen3ForCausalLM")
    model_class = getattr(transformers, json.loads((folder / "config.json").read_text())["architectures"][0])
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW, model_class=model_class)


def test_exaone4_5_checkpoint_serves_its_language_model(tmp_path):
    """EXAONE 4.5: an EXAONE 4.0 (windows, a global layer without rotary) behind Qwen2.5-VL's
    vision tower; equal to transformers' multimodal model on text, the tower unread."""
    import transformers

    from services.worker.loader import iter_weights

    folder = build_tiny_model(tmp_path / "mm", "exaone4_5", seed=2)
    assert not any("visual" in name for name, _ in iter_weights(folder))
    llm = LLM(str(folder))
    config = llm.runner.model_config
    assert (config.architecture, config.layer_windows) == ("Exaone4ForCausalLM", (24, 24, 24, 0))
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW,
                                                   model_class=transformers.Exaone4_5_ForConditionalGeneration)


def test_qwen3_vl_moe_serves_its_stacked_experts_in_either_layout(tmp_path):
    """Qwen3-VL-MoE's language model (a Qwen3-MoE, its router always renormalizing) with its
    experts stacked: [experts, out, in] as transformers 5 saves them, and [experts, in, out]
    as the Hub ships them; both equal to transformers' multimodal model on text."""
    import transformers
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "mm", "qwen3_vl_moe", seed=2)
    want = hf_greedy(folder, PROMPTS, MAX_NEW, model_class=transformers.Qwen3VLMoeForConditionalGeneration)
    llm = LLM(str(folder))
    config = llm.runner.model_config
    assert (config.architecture, config.num_experts, config.norm_topk_prob) == ("Qwen3MoeForCausalLM", 8, True)
    assert generate_ids(llm, PROMPTS) == want
    weights = load_file(folder / "model.safetensors")
    hub = {name: (t.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                  else t) for name, t in weights.items()}
    assert hub["model.language_model.layers.0.mlp.experts.down_proj"].shape == (8, 48, 64)  # [experts, in, out]
    save_file(hub, folder / "model.safetensors", metadata={"format": "pt"})
    assert generate_ids(LLM(str(folder)), PROMPTS) == want


def test_qwen2_5_vl_config_as_its_first_releases_ship_it(tmp_path):
    """Qwen2.5-VL-3B-Instruct's config.json as first published: the language model's keys
    at the top level (no text_config), rope_scaling of type "mrope"; read as transformers
    reads it (a Qwen2 with its qkv bias, the ordinary rotary on text, tied as it says)."""
    from services.worker.models.decoder_config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": 32768, "use_sliding_window": False,
        "rms_norm_eps": 1e-6, "vision_config": {"depth": 32, "out_hidden_size": 2048}}))
    config = ModelConfig.from_folder(tmp_path)
    assert (config.architecture, config.head_dim, config.qkv_bias, config.rope_theta, config.rope_scaling) == (
        "Qwen2ForCausalLM", 128, True, 1e6, {"rope_type": "default"})
    assert (config.tie_word_embeddings, config.eos_token_id, config.layer_windows, config.sliding_window,
            config.max_model_len) == (True, 151645, (), None, 128000)


def test_gemma3_multimodal_config_as_the_hub_ships_it_gets_transformers_defaults(tmp_path):
    """gemma-3-4b-it's config.json names 6 keys of its text_config; the rest are
    transformers' Gemma3TextConfig defaults (8 heads of 256 over 4, a window every layer
    but each sixth, the local base 1e4, 131072 positions) and the LM head is tied."""
    from services.worker.models.decoder_config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"}}))
    config = ModelConfig.from_folder(tmp_path)
    assert (config.architecture, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        "Gemma3ForCausalLM", 8, 4, 256)
    assert config.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    assert (config.rope_theta, config.rope_scaling, config.local_rope_theta) == (
        1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
    assert (config.max_position_embeddings, config.tie_word_embeddings, config.eos_token_id, config.qk_norm,
            config.attention_scale) == (131072, True, 1, True, 256**-0.5)


@needs_cpu_kernels
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_s_head_dim_256_attends_on_the_cpu_kernels_and_matches(tmp_path, monkeypatch, arch):
    """Every Gemma has heads of 256 dims: the CPU kernels' decode attention takes them,
    windowed and soft-capped, and the prefill kernel Gemma 3's unwindowed chunks."""
    import kernels.cpu as cpu_kernels

    folder = build_tiny_model(tmp_path / "m", arch, seed=2, head_dim=256)
    calls = {"paged_decode_attention": 0, "paged_prefill_attention": 0}
    for name in calls:
        kernel = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _k=kernel, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _k(*a))
    got = generate_ids(LLM(str(folder)), PROMPTS)
    assert cpu_kernels.available() and calls["paged_decode_attention"] > 0, calls
    assert calls["paged_prefill_attention"] > 0 or arch == "gemma2", calls  # every Gemma 2 layer is capped
    assert got == hf_greedy(folder, PROMPTS, MAX_NEW)


def test_gemma2_serves_past_its_window_and_reads_only_the_window(tmp_path, monkeypatch):
    """The context is max_position_embeddings, not the window; a long prompt's decodes on
    a windowed layer gather only the blocks the window covers (4 of 16-token blocks for a
    window of 24 ending mid-block), the full layer all of them; output equals transformers'."""
    from services.worker.attention import torch_backend

    folder = build_tiny_model(tmp_path / "m", "gemma2", seed=2)
    llm = LLM(str(folder), block_size=16)
    assert llm.max_model_len == 1024
    gathered = []
    gather = torch_backend.gather_kv
    monkeypatch.setattr(torch_backend, "gather_kv", lambda cache, ids, *a: gathered.append(len(ids)) or gather(cache, ids, *a))
    prompt = random_prompts([300], seed=9)
    assert generate_ids(llm, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) == hf_greedy(
        folder, prompt, 4)
    # decodes at positions 300..302 (seq_len 301..303): a window of 24 from 277..279 starts in block 17
    # and ends in block 18 - two blocks of K and two of V per windowed layer (layers 0 and 2); 19 blocks for layer 1
    decodes = gathered[-3 * 3 * 2:]
    assert sorted(set(decodes)) == [2, 19], decodes


@needs_cpu_kernels
@pytest.mark.parametrize("arch, head_dim", [("qwen3", 64), ("gemma2", 256), ("gemma3", 256)])
def test_qwen3_and_gemma_run_the_cpu_kernels_one_call_decode_layer_and_match(tmp_path, arch, head_dim):
    """Where the CPU kernels take their heads, Qwen3's query/key norms and Gemma's GeGLU,
    norms of each branch, soft caps, windows and rotary bases per layer run in the one-call
    decode layer: float32 equals transformers; bfloat16's first tokens do too."""
    folder = build_tiny_model(tmp_path / arch, arch, seed=5, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=head_dim, intermediate_size=256, initializer_range=0.08)
    f32 = LLM(str(folder))
    assert f32.runner.model.fused_decode is not None
    reference = hf_greedy(folder, PROMPTS, MAX_NEW)
    assert generate_ids(f32, PROMPTS) == reference
    bf16 = LLM(str(folder), dtype="bfloat16")
    assert bf16.runner.model.fused_decode is not None
    assert [ids[0] for ids in generate_ids(bf16, PROMPTS)] == [ids[0] for ids in reference]  # a near-tie may flip later on


@needs_cpu_kernels
def test_granite_runs_the_cpu_kernels_one_call_decode_layer_and_matches(tmp_path):
    """Its residual multiplier is folded into the weights at load, its embedding multiplier
    applied before the layers and its attention scale passed on: the C layer takes it."""
    folder = build_tiny_model(tmp_path / "hd64", "granite", seed=5, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=256, initializer_range=0.08)
    llm = LLM(str(folder))
    assert llm.runner.model.fused_decode is not None
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)


def test_gemma_scales_its_embeddings_by_the_scale_rounded_as_transformers_does(tmp_path):
    """sqrt(48) is 6.93 but 6.94 in bfloat16, which transformers multiplies by (its
    buffer cast to the weights' dtype): the same bits."""
    import torch

    folder = build_tiny_model(tmp_path / "g", "gemma", seed=1, hidden_size=48, num_attention_heads=4,
                              num_key_value_heads=2)
    ids = torch.tensor(PROMPTS[3])
    model = LLM(str(folder), dtype="bfloat16").runner.model
    theirs = causal_lm_class(folder).from_pretrained(folder, dtype=torch.bfloat16).model.embed_tokens(ids[None])[0]
    assert torch.equal(model.embed(ids), theirs)
    assert not torch.equal(model.model.embed_tokens(ids) * 48**0.5, theirs)  # unrounded, some bits differ


def _prefix_agreement(outputs, reference) -> float:
    """Mean length of the common start of each output with float32's."""
    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return sum(common(out, ref) for out, ref in zip(outputs, reference)) / len(reference)


# (the recurrent state of Qwen3.5's and Granite 4.0-H's hybrids carries a rounding through
# every later token: transformers' own bfloat16 parts from its float32 sooner than a
# Llama's, so they are held to that instead, tests/test_hybrid_models.py)
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "granite_hybrid", "granite_hybrid_dense", "bamba",
           "nemotron_h")


@pytest.fixture(scope="session")
def llama_precision(tmp_path_factory) -> tuple[dict, dict]:
    """The Llama's band, measured once a process: the same model and seed for every family."""
    return _measure_precision_agreement(tmp_path_factory.mktemp("precision"), "llama")


def _measure_precision_agreement(tmp_path, name: str) -> tuple[dict, dict]:
    """Against the same model's float32 greedy output: the tokens agreeing before the first
    difference, and the prompts whose first token agrees, in bfloat16 and int8 and int4."""
    shape = dict(seed=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=256, initializer_range=0.08)
    extra = {"moe_intermediate_size": 64} if name == "qwen3_moe" else {}
    folder = build_tiny_model(tmp_path / f"precision-{name}", name, **shape, **extra)
    reference = generate_ids(LLM(str(folder)), PROMPTS)
    agreement, first_tokens = {}, {}
    for quantization in (None, "int8", "int4"):
        out = generate_ids(LLM(str(folder), dtype="bfloat16", quantization=quantization), PROMPTS)
        assert all(len(ids) == MAX_NEW for ids in out)
        agreement[name, quantization] = _prefix_agreement(out, reference)
        first_tokens[name, quantization] = sum(a[0] == b[0] for a, b in zip(out, reference))
    return agreement, first_tokens


@pytest.mark.parametrize("arch", [f for f in FAMILIES if f not in HYBRIDS])
def test_bfloat16_int8_and_int4_agree_with_float32_as_llama_does(tmp_path, arch, llama_precision):
    """Lower precision parts from float32's greedy output sooner or later on tiny random
    models (their logits are close): each family must stay within the band a Llama of the
    same shape and seed shows (measured for Qwen3: bf16 ~15-23 of 24 tokens, int8 ~8-15,
    int4 ~1.5-1.9, as Llama's; Qwen3-MoE's int4 0.6, its experts' products being short), not fall to nothing as a norm or a router lost in a
    quantized path would make it. Experts run on the same kernels as dense layers."""
    family_agreement, family_first = _measure_precision_agreement(tmp_path, arch)
    agreement, first_tokens = {**llama_precision[0], **family_agreement}, {**llama_precision[1], **family_first}
    for quantization in (None, "int8"):
        assert agreement[arch, quantization] >= 0.5 * agreement["llama", quantization], agreement
    assert agreement[arch, None] >= 8, agreement
    # int4 parts within a token or two here, Llama too: the first token is what it keeps
    # (a broken path would match 1 in 384 by chance).
    assert first_tokens[arch, "int4"] >= 2, (first_tokens, agreement)


def test_qwen3_sliding_window_that_is_switched_off_does_not_cap_the_context(tmp_path):
    folder = build_tiny_model(tmp_path / "sw", "qwen3", seed=2)
    config = json.loads((folder / "config.json").read_text())
    config.update(sliding_window=64, use_sliding_window=False, max_position_embeddings=1024)
    (folder / "config.json").write_text(json.dumps(config))
    assert LLM(str(folder)).max_model_len == 1024


# ---- Phi-3: fused qkv/gate_up in the checkpoint, longrope, partial rotary ---------------

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.5],
            "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 11.0, 15.0]}
# Around the threshold of 32: prompts under it whose outputs cross it, and prompts past it.
PHI3_PROMPTS = random_prompts([1, 5, 20, 31, 32, 33, 50], seed=4)


def phi3(tmp_path, name="phi3", **overrides):
    return build_tiny_model(tmp_path / name, "phi3", seed=4, max_position_embeddings=256, **overrides)


@pytest.mark.parametrize("variant", ["default_rope", "longrope", "longrope_partial", "partial"])
@pytest.mark.parametrize("case", CASES)
def test_phi3_matches_transformers(tmp_path, variant, case):
    rope = {"default_rope": {}, "partial": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.5}},
            "longrope": {"rope_parameters": LONGROPE, "original_max_position_embeddings": 32},
            "longrope_partial": {"rope_parameters": {**LONGROPE, "partial_rotary_factor": 0.5,
                                                     "short_factor": LONGROPE["short_factor"][:4],
                                                     "long_factor": LONGROPE["long_factor"][:4]},
                                 "original_max_position_embeddings": 32}}[variant]
    folder = phi3(tmp_path, **rope)
    llm = LLM(str(folder), **CASES[case])
    config = llm.runner.model_config
    assert config.long_rope_threshold == (32 if "longrope" in variant else None)
    assert config.rotary_dim == (8 if "partial" in variant else 0)
    assert generate_ids(llm, PHI3_PROMPTS) == hf_greedy(folder, PHI3_PROMPTS, MAX_NEW)


def test_phi3_longrope_blocks_are_not_shared_across_the_threshold(tmp_path):
    """Past the threshold a sequence is rotated with the long factors from its first token
    (transformers' Phi-3 recomputes it there), so a long prompt must not hit the blocks a
    short one left, must hit those another long one left, and a request that grows past
    the threshold restarts long and still equals transformers."""
    folder = phi3(tmp_path, rope_parameters=LONGROPE, original_max_position_embeddings=32)
    head = random_prompts([16], seed=9)[0]
    short = head + [7, 8, 9]  # 19 tokens + 5 generated: stays short
    long_a, long_b = head + random_prompts([30], seed=10)[0], head + random_prompts([40], seed=11)[0]
    crossing = head + [5, 6]  # 18 + 24 generated: crosses at 33
    llm = LLM(str(folder), block_size=16)
    got, expected = [], []
    for prompt, max_new, hits in [(short, 5, 0), (long_a, MAX_NEW, 0), (long_b, MAX_NEW, 16), (crossing, MAX_NEW, None)]:
        before = llm.stats().prefix_cache_hits
        got += generate_ids(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))
        expected += hf_greedy(folder, [prompt], max_new)
        if hits is not None:
            assert llm.stats().prefix_cache_hits - before == hits
    assert got == expected
    assert llm.stats().num_preemptions == 0  # the restart at the threshold is no preemption


@pytest.mark.parametrize("options", [{"async_scheduling": False}, {"speculative_config": {
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
    "disable_by_batch_size": None}}], ids=["sync", "speculative"])
def test_phi3_longrope_crossing_under_other_scheduling(tmp_path, options):
    folder = phi3(tmp_path, rope_parameters=LONGROPE, original_max_position_embeddings=32)
    llm = LLM(str(folder), **options)
    assert generate_ids(llm, PHI3_PROMPTS) == hf_greedy(folder, PHI3_PROMPTS, MAX_NEW)


@needs_cpu_kernels
def test_phi3_longrope_with_partial_rotary_runs_the_one_call_decode_layer_and_matches(tmp_path):
    """Phi-4-mini's kind of layer (longrope over a partial rotary) at a head size the CPU
    kernels take: the one-call decode layer rotates each head's leading dims by the long or
    short rows the positions pick, and equals transformers across the threshold."""
    rope = {**LONGROPE, "partial_rotary_factor": 0.5, "short_factor": [1.0 + 0.1 * i for i in range(16)],
            "long_factor": [1.5 + 0.5 * i for i in range(16)]}
    folder = phi3(tmp_path, rope_parameters=rope, original_max_position_embeddings=32, hidden_size=128,
                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    llm = LLM(str(folder))
    assert llm.runner.model.fused_decode is not None and llm.runner.model_config.rotary_dim == 32
    assert generate_ids(llm, PHI3_PROMPTS) == hf_greedy(folder, PHI3_PROMPTS, MAX_NEW)


def test_phi3_unsupported_rope_configs_are_refused_by_name(tmp_path):
    folder = phi3(tmp_path, rope_parameters=LONGROPE, original_max_position_embeddings=32)
    config = json.loads((folder / "config.json").read_text())
    bad = {**config, "rope_parameters": {**config["rope_parameters"], "long_factor": [1.0]}}
    (folder / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="long_factor of 8 values"):
        LLM(str(folder))
    bad = {**config, "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0, "factor": 2.0}}
    (folder / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unsupported rope_type 'axial'"):
        LLM(str(folder))


def test_gpt2_and_pythia_as_the_hub_ships_them(tmp_path):
    """GPT-2's checkpoint as openai-community/gpt2's: names without `transformer.`, its
    causal-mask buffers beside the weights; Pythia's config as EleutherAI's: rotary_pct and
    rotary_emb_base, not rope_parameters. Both equal to transformers."""
    import torch
    from safetensors.torch import load_file, save_file

    gpt2 = build_tiny_model(tmp_path / "gpt2", "gpt2", seed=2)
    want = hf_greedy(gpt2, PROMPTS, MAX_NEW)
    weights = load_file(gpt2 / "model.safetensors")
    hub = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    hub.update({f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 8, 8)) for i in range(2)})
    save_file(hub, gpt2 / "model.safetensors", metadata={"format": "pt"})
    assert generate_ids(LLM(str(gpt2)), PROMPTS) == want

    pythia = build_tiny_model(tmp_path / "pythia", "gpt_neox", seed=3)
    want = hf_greedy(pythia, PROMPTS, MAX_NEW)
    config = json.loads((pythia / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    (pythia / "config.json").write_text(json.dumps(config))
    llm = LLM(str(pythia))
    assert llm.runner.model_config.rotary_dim == 8
    assert generate_ids(llm, PROMPTS) == want


def test_a_layer_normed_config_the_loader_would_mishandle_is_refused_by_name(tmp_path):
    """opt-350m's projected embeddings and norms after each branch, GPT-2's per-layer
    attention scale, Phi's query/key norms: each named, none loaded wrongly."""
    opt = build_tiny_model(tmp_path / "opt", "opt", seed=2)
    config = json.loads((opt / "config.json").read_text())
    (opt / "config.json").write_text(json.dumps({**config, "word_embed_proj_dim": 32}))
    with pytest.raises(ValueError, match="word_embed_proj_dim 32"):
        LLM(str(opt))
    (opt / "config.json").write_text(json.dumps({**config, "do_layer_norm_before": False}))
    with pytest.raises(ValueError, match="do_layer_norm_before false"):
        LLM(str(opt))
    (opt / "config.json").write_text(json.dumps({**config, "architectures": ["OPTForSequenceClassification"]}))
    with pytest.raises(ValueError, match="its ForSequenceClassification is not served"):
        LLM(str(opt))
    gpt2 = build_tiny_model(tmp_path / "gpt2", "gpt2", seed=2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        LLM(str(gpt2))
    phi = build_tiny_model(tmp_path / "phi", "phi", seed=2)
    config = json.loads((phi / "config.json").read_text())
    (phi / "config.json").write_text(json.dumps({**config, "qk_layernorm": True}))
    with pytest.raises(ValueError, match="qk_layernorm"):
        LLM(str(phi))


def test_mxfp4_widens_as_transformers_widens():
    """gpt-oss's released experts: 4-bit e2m1 codes, two a byte, a power of two per 32."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from services.worker.models.checkpoints.gpt_oss_weights import widen_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 134, (3, 8, 2), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [experts, in, out]
    assert torch.equal(widen_mxfp4(blocks, scales), theirs.transpose(1, 2))


def test_gpt_oss_serves_its_mxfp4_experts(tmp_path):
    """The released checkpoints' layout: experts as MXFP4 blocks and scales beside a
    quantization_config. Expert weights drawn on the MXFP4 grid, so the same model saved
    widened is transformers' reference, token for token."""
    import torch
    from safetensors.torch import load_file, save_file

    from services.worker.models.checkpoints.gpt_oss_weights import widen_mxfp4

    folder = build_tiny_model(tmp_path / "oss", "gpt_oss", seed=3)
    weights = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    packed = {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, out = weights[name].shape
        blocks = torch.randint(0, 256, (experts, out, fan_in // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(122, 125, (experts, out, fan_in // 32), dtype=torch.uint8, generator=gen)
        weights[name] = widen_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    want = hf_greedy(folder, PROMPTS, MAX_NEW)
    released = {**{n: t for n, t in weights.items() if not n.endswith(("gate_up_proj", "down_proj"))}, **packed}
    save_file(released, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router",
                                                                                        "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    assert generate_ids(LLM(str(folder)), PROMPTS) == want
    del released[next(n for n in released if n.endswith("down_proj_scales"))]
    save_file(released, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks without its down_proj_scales"):
        LLM(str(folder))


def test_stablelm_with_its_branches_side_by_side_matches_transformers(tmp_path):
    """use_parallel_residual: attention and MLP off one norm, summed residual first."""
    folder = build_tiny_model(tmp_path / "s", "stablelm", seed=2, use_parallel_residual=True)
    llm = LLM(str(folder))
    assert (llm.runner.model_config.parallel_residual, llm.runner.model_config.residual_first) == (True, True)
    assert generate_ids(llm, PROMPTS) == hf_greedy(folder, PROMPTS, MAX_NEW)
