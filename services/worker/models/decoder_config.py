"""What the worker needs to know of a Hugging Face model folder, read from config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.models.checkpoints.fp8_weights import fp8_weight_block
from services.worker.models.checkpoints.quantized_weights import QuantizedWeights, quantized_weight_format
from shared.hf.classification import SUFFIX, is_classifier, num_labels

# Architectures whose modules `models/decoder.py` reproduces: Qwen2 differs only by its
# qkv bias, Qwen3 by a per-head RMSNorm on queries and keys before rotary.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    # InternLM3 (internlm3-8b-instruct): a Llama, its biases under names of its own (qkv_bias,
    # bias), dynamic NTK rope (the default frequencies at every length llmbus serves)
    "InternLM3ForCausalLM": "llama",
    # Helium (Kyutai's helium-1): a Llama rotating interleaved pairs, o_proj never biased
    "HeliumForCausalLM": "llama",
    # Ministral 3 (3B, 8B, 14B): a Mistral whose queries grow past the pretrained context
    # (Llama 4's temperature by position, layers/query_scale.py)
    "Ministral3ForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    # Phi-3: q/k/v and gate/up come fused in the checkpoint, as our modules hold them;
    # longrope scaling and partial rotary.
    "Phi3ForCausalLM": "llama",
    # Mixture of experts: the same decoder with a sparse MLP (layers/moe.py) where the config says.
    "MixtralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, each sparse layer with
    # a shared expert beside the routed ones, its output gated by a sigmoid of the token's own.
    "Qwen2MoeForCausalLM": "llama",
    # Granite: a Llama with four scalars (embedding, residual and attention multipliers, a
    # logits divisor).
    "GraniteForCausalLM": "llama",
    # Granite 3's MoE (granite-3.x-1b-a400m, 3b-a800m): Granite's scalars, every layer sparse,
    # its experts stacked in the checkpoint, weighed by a softmax over the k chosen logits.
    "GraniteMoeForCausalLM": "llama",
    # OLMoE (OLMoE-1B-7B): OLMo 2's query/key norms over all heads, before the usual pre-norms,
    # and a sparse MLP in every layer: 64 experts, top 8, weighed by the softmax over all
    # (norm_topk_prob false) as Qwen3-MoE's
    "OlmoeForCausalLM": "llama",
    # FlexOlmo (FlexOlmo-7x7B): OLMo 2's layer (norms after each branch, query/key norms over
    # all heads) with OLMoE's sparse MLP in every layer
    "FlexOlmoForCausalLM": "llama",
    # Solar Open (Solar-Open-100B): a Llama's attention (o_proj unbiased) with GLM-4.5's
    # experts (DeepSeek-V3's router, shared experts) in every layer
    "SolarOpenForCausalLM": "llama",
    # MiniMax-M2: OLMoE's query/key norms over all heads, a partial rotary (`rotary_dim`),
    # every layer sparse: experts chosen by sigmoid score plus a correction bias, weighed by
    # their scores renormalized (DeepSeek-V3's router without groups or scaling)
    "MiniMaxM2ForCausalLM": "llama",
    # GLM-4.5 and 4.6 (GLM-4.5-Air): GLM's biased q/k/v with half of each head rotating (as
    # NeoX's halves), optional per-head query/key norms; after the first dense layers,
    # DeepSeek-V3's experts: a sigmoid router whose choice adds a correction bias, within the
    # best groups, its weights renormalized and scaled, and ungated shared experts; the
    # checkpoint's multi-token-prediction layers are skipped, as transformers skips them
    "Glm4MoeForCausalLM": "llama",
    # DeepSeek-V3 (and R1, V3.1; Kimi K2's and Moonlight's weights): multi-head latent attention (keys and values
    # from one small latent a token, the cache holding the latent) with GLM-4.5's experts
    # after the first dense layers; its multi-token-prediction layers skipped as GLM's
    "DeepseekV3ForCausalLM": "llama",
    # DeepSeek-V2 (V2-Lite, V2.5, Coder-V2): V3's latent attention; after the first dense
    # layers, experts chosen by softmax score alone (within the best groups, a group by its
    # best expert, where topk_method says), unnormalized and scaled, beside shared experts
    "DeepseekV2ForCausalLM": "llama",
    # GLM-4.7-Flash: DeepSeek-V3's model, its dense and sparse layers by mlp_layer_types
    "Glm4MoeLiteForCausalLM": "llama",
    # Youtu-LLM (2B): DeepSeek-V3's latent attention in a dense Llama
    "YoutuForCausalLM": "llama",
    # Mistral 4: DeepSeek-V3's latent attention with Ministral 3's queries by position, its
    # experts chosen by softmax score alone within the best groups (a group by its two best)
    "Mistral4ForCausalLM": "llama",
    # dots.llm1: Qwen3's attention (windows by layer_types) with GLM-4.5's (DeepSeek-V3's)
    # experts and shared experts after the first dense layers
    "Dots1ForCausalLM": "llama",
    # Gemma: a GELU-gated MLP, norms that weigh by 1 + w, embeddings scaled by sqrt(hidden).
    "GemmaForCausalLM": "llama",
    # Gemma 2: Gemma with norms after attention and after the MLP too, every other layer
    # attending over a sliding window, and attention scores and logits soft-capped (tanh).
    "Gemma2ForCausalLM": "llama",
    # VaultGemma (vaultgemma-1b): Gemma 2 without the norms on the attention's and the MLP's
    # outputs (its pre_feedforward_layernorm the MLP's input norm, as a Llama's)
    "VaultGemmaForCausalLM": "llama",
    # Gemma 3 (text): Gemma 2's layer without the caps, with Qwen3's query/key norms, five
    # windowed layers to one global, and the windowed ones rotating with a base of their own.
    "Gemma3ForCausalLM": "llama",
    # SmolLM3: a Llama whose every fourth layer (no_rope_layers' zeros) attends without
    # rotary positions (NoPE), tied embeddings by default.
    "SmolLM3ForCausalLM": "llama",
    # OLMo 2: a norm on each branch's output and none before it (Gemma 2's output norms
    # without its input norms), and query/key norms over all heads at once.
    "Olmo2ForCausalLM": "llama",
    # OLMo 3: OLMo 2's layer, three windowed layers to one global (by layer_types), the
    # global ones' rotary scaled apart (YaRN, in its long-context checkpoints).
    "Olmo3ForCausalLM": "llama",
    # GLM-4 (glm-4-9b-chat-hf: GlmForCausalLM): a Qwen2-like layer (q/k/v biases) with gate/up
    # fused in the checkpoint, half of each head rotating, by interleaved pairs.
    "GlmForCausalLM": "llama",
    # GLM-4-0414 and GLM-Z1: GLM's layer with Gemma 2's four norms (under names of their own)
    "Glm4ForCausalLM": "llama",
    # ERNIE 4.5 (dense: ERNIE-4.5-0.3B): a Llama rotating interleaved pairs (as GLM's), tied,
    # every projection biased where `use_bias` says
    "Ernie4_5ForCausalLM": "llama",
    # ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): its dense layer and, every
    # moe_layer_interval from moe_layer_start_index, experts chosen by softmax probability
    # plus a correction bias (moe_statics), beside ungated shared experts
    "Ernie4_5_MoeForCausalLM": "llama",
    # EXAONE 4.0: OLMo 2's output norms with Qwen3's per-head query/key norms; with a window,
    # three windowed layers to one global (layer_types), the global ones without rotary (NoPE).
    "Exaone4ForCausalLM": "llama",
    # EXAONE MoE (K-EXAONE): EXAONE 4.0's attention (per-head query/key norms, windows by
    # layer_types, the global layers NoPE) under the usual pre-norms, with DeepSeek-V3's
    # experts where mlp_layer_types says; its multi-token-prediction weights (mtp.*) unread
    "ExaoneMoeForCausalLM": "llama",
    # Seed-OSS: a Llama with q/k/v biases by default, o_proj's apart (attention_out_bias)
    "SeedOssForCausalLM": "llama",
    # Hunyuan dense (Hunyuan-0.5B to 7B): a Llama whose per-head query/key norms come after
    # rotary, not before (Qwen3's order); its rotary base raised by an NTK alpha
    "HunYuanDenseV1ForCausalLM": "llama",
    # Hunyuan MoE (Hunyuan-A13B): Hunyuan's attention, every layer sparse (a softmax router,
    # top-k renormalized) beside a shared MLP added unweighed
    "HunYuanMoEV1ForCausalLM": "llama",
    # Arcee (AFM-4.5B): a Llama whose MLP has no gate: down(relu(up x) ** 2)
    "ArceeForCausalLM": "llama",
    # Apertus (Apertus-8B, 70B): Arcee's ungated MLP with the xIELU activation (two learned
    # scalars a layer), Qwen3's query/key norms, the two norms under names of their own
    "ApertusForCausalLM": "llama",
    # gpt-oss (gpt-oss-20b, 120b): a sparse MLP in every layer whose router and experts are
    # biased and whose experts gate with a clamped SwiGLU of their own; per-head attention
    # sinks; windowed and global layers alternating; YaRN. Its experts' MXFP4 blocks are
    # widened to the model's dtype at load.
    "GptOssForCausalLM": "llama",
    # The LayerNorm decoders (LAYER_NORMED): biased LayerNorms, ungated biased MLPs.
    # OPT (vLLM's quickstart model, facebook/opt-125m): learned positions offset by 2, no
    # rotary, queries scaled before their product with the keys, ReLU.
    "OPTForCausalLM": "llama",
    # GPT-2: learned positions, no rotary, q/k/v fused, products stored transposed (Conv1D)
    "GPT2LMHeadModel": "llama",
    # GPT-NeoX (Pythia): attention and MLP side by side off the same residual (each its own
    # norm), a quarter of each head rotating, q/k/v fused and interleaved head by head
    "GPTNeoXForCausalLM": "llama",
    # Phi (phi-1.5, phi-2): attention and MLP side by side off one norm, partial rotary, an
    # LM head with a bias
    "PhiForCausalLM": "llama",
    # StarCoder2: biased LayerNorms and projections, an ungated MLP (c_fc, c_proj), GQA,
    # a window on every layer where the config has one
    "Starcoder2ForCausalLM": "llama",
    # StableLM (stablelm-2, stablelm-3b-4e1t): Llama's gated MLP and GQA under biased
    # LayerNorms, a quarter of each head rotating, q/k/v biased where `use_qkv_bias` says,
    # attention and MLP side by side off one norm where `use_parallel_residual` says
    "StableLmForCausalLM": "llama",
    # Cohere (Command R, Aya): LayerNorms without a bias, attention and MLP side by side off
    # one norm, interleaved rotary, logits times logit_scale, tied
    "CohereForCausalLM": "llama",
    # Cohere 2 (Command R7B, Command A): Cohere's layer, three windowed layers to one global
    # (layer_types), only the windowed ones rotating (the global ones NoPE)
    "Cohere2ForCausalLM": "llama",
    # AFMoE (Arcee's Trinity): Qwen3's query/key norms, attention outputs gated by a sigmoid
    # of the layer's input, windowed layers rotating and global ones not (layer_types), Gemma
    # 2's four norms, then after the first dense layers experts chosen by sigmoid score plus
    # a correction bias, renormalized and scaled, beside shared experts
    "AfmoeForCausalLM": "llama",
    # Jais 2 (Jais-2-8B): biased LayerNorms and projections (StarCoder2's layer) with GQA,
    # rotary, and an ungated relu2 MLP (up_proj, down_proj)
    "Jais2ForCausalLM": "llama",
    # Qwen3.5: Gated DeltaNet layers (linear attention, a recurrent state a request) and,
    # one in four, full attention with gated outputs
    "Qwen3_5ForCausalLM": "llama",
    # Qwen3.5's and Qwen3-Next's with Qwen2-MoE's sparse layers (a gated shared expert)
    "Qwen3_5MoeForCausalLM": "llama",
    "Qwen3NextForCausalLM": "llama",
    # OLMo Hybrid: Gated DeltaNet layers normed as a Llama's, full attention one in four
    # normed as OLMo 2's
    "OlmoHybridForCausalLM": "llama",
    # LFM2: gated short convolutions (a state of a few tokens a request) between attention layers
    "Lfm2ForCausalLM": "llama",
    "Lfm2MoeForCausalLM": "llama",  # (LFM2-8B-A1B: sparse MLPs after its first dense ones)
    # LFM3: LFM2's convolutions beside sliding and full attention (its heads' outputs gated),
    # four norms a layer
    "Lfm3ForCausalLM": "llama",
    # Granite 4.0-H: Mamba2 layers between attention layers without positions, Granite's
    # scalars, GraniteMoe's experts beside a shared MLP (or that MLP alone: H-Micro)
    "GraniteMoeHybridForCausalLM": "llama",
    "BambaForCausalLM": "llama",  # (Bamba-9B: Mamba2 layers and rotating attention ones, each with a Llama MLP)
    # Nemotron-H: blocks of one branch each (Mamba2, attention without positions, or an
    # ungated relu2 MLP)
    "NemotronHForCausalLM": "llama",
}
COHERES = ("CohereForCausalLM", "Cohere2ForCausalLM")
# Hybrids: linear-attention layers (layers/gated_delta_net.py) between full-attention ones
LINEAR_ATTENTION = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
OLMO_HYBRID = "OlmoHybridForCausalLM"  # (its Gated DeltaNet read apart: layers/gated_delta_net.py)
# Hybrids whose other layers are gated short convolutions (layers/short_conv.py)
SHORT_CONVS = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM")
# Hybrids whose other layers are Mamba2's selective state spaces (layers/mamba2.py)
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
MAMBAS = (GRANITE_HYBRID, "BambaForCausalLM", "NemotronHForCausalLM")
# DeepSeek-V3's experts (its grouped sigmoid router, ungated shared experts) under other attention
DEEPSEEK_V3_MOES = ("Glm4MoeForCausalLM", "Dots1ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
                    "SolarOpenForCausalLM")
# Multi-head latent attention (layers/latent_attention.py) in place of the usual heads
LATENT_ATTENTION = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "Glm4MoeLiteForCausalLM", "Mistral4ForCausalLM",
                    "YoutuForCausalLM")
# Llama 4's temperature by position on the queries (rope's llama_4_scaling_beta)
QUERIES_SCALED_BY_POSITION = ("Ministral3ForCausalLM", "Mistral4ForCausalLM")
HUNYUANS = ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")
EXAONES = ("Exaone4ForCausalLM", "ExaoneMoeForCausalLM")
LAYER_NORMED = ("OPTForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "PhiForCausalLM", "Starcoder2ForCausalLM",
                "StableLmForCausalLM", *COHERES, "Jais2ForCausalLM")
# Families whose *ForSequenceClassification is refused: their classifiers' heads and
# pooling are not held to transformers here
UNCLASSIFIED = (*LAYER_NORMED, "GptOssForCausalLM", *DEEPSEEK_V3_MOES, *LATENT_ATTENTION, *QUERIES_SCALED_BY_POSITION,
                "ExaoneMoeForCausalLM", "AfmoeForCausalLM", "HunYuanMoEV1ForCausalLM", "Ernie4_5_MoeForCausalLM",
                "MiniMaxM2ForCausalLM", *LINEAR_ATTENTION, OLMO_HYBRID, *SHORT_CONVS, *MAMBAS)
# Learned absolute positions in place of rotary: the offset of a position's row in the table
LEARNED_POSITIONS = {"OPTForCausalLM": 2, "GPT2LMHeadModel": 0}
GLMS = ("GlmForCausalLM", "Glm4ForCausalLM")
OLMOS = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
# Query/key norms over all of a token's heads at once (OLMo 2's), wherever its norms are
QK_NORMS_OVER_HEADS = (*OLMOS, "OlmoeForCausalLM", "MiniMaxM2ForCausalLM", "FlexOlmoForCausalLM", "OlmoHybridForCausalLM")
# No norm before attention and the MLP, one on each's output instead
POST_NORMED = (*OLMOS, "Exaone4ForCausalLM", "FlexOlmoForCausalLM")
# Rotary setups by layer type (rope_parameters' full_attention and sliding_attention)
ROPES_BY_LAYER_TYPE = ("Gemma3ForCausalLM", "Olmo3ForCausalLM", "Lfm3ForCausalLM")
GEMMAS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "VaultGemmaForCausalLM")
# Sliding windows as transformers applies them (layer_windows): on every layer, where the
# config has one (Mistral-7B-v0.1: 4096; Phi-3-mini-4k: 2047), Qwen's where it says, Gemma's
# by layer type. A Llama config's window (which transformers' Llama ignores) caps the context.
EVERY_LAYER_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM",
                        "Ministral3ForCausalLM")
QWENS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# Windowed where `use_sliding_window` says, on the layers `layer_types` names (transformers'
# default for these: Qwen's from max_window_layers on, SmolLM3's on its NoPE layers).
BY_LAYER_TYPE = (*QWENS, "SmolLM3ForCausalLM")
# Windowed where `layer_types` says, always (no use_sliding_window switch)
ALWAYS_BY_LAYER_TYPE = ("Olmo3ForCausalLM", *EXAONES, "GptOssForCausalLM", "Cohere2ForCausalLM", "AfmoeForCausalLM",
                        "Dots1ForCausalLM")
WINDOWED = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "VaultGemmaForCausalLM", *ALWAYS_BY_LAYER_TYPE, *EVERY_LAYER_WINDOWED, *BY_LAYER_TYPE,
            "Lfm3ForCausalLM")
# Families whose config.json may leave out what their transformers config class defaults
# differently from a Llama's (SmolLM3: tied embeddings, a rotary base of 2e6, NoPE every
# fourth layer): read through that class, as transformers reads them.
FILLED_BY_TRANSFORMERS = {"SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3",
                          "GlmForCausalLM": "glm", "Glm4ForCausalLM": "glm4", "Ernie4_5ForCausalLM": "ernie4_5",
                          "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
                          "Exaone4ForCausalLM": "exaone4", "SeedOssForCausalLM": "seed_oss",
                          "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense", "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
                          "ArceeForCausalLM": "arcee",
                          "ApertusForCausalLM": "apertus", "OPTForCausalLM": "opt", "GPT2LMHeadModel": "gpt2",
                          "GPTNeoXForCausalLM": "gpt_neox", "PhiForCausalLM": "phi", "GptOssForCausalLM": "gpt_oss",
                          "Starcoder2ForCausalLM": "starcoder2", "StableLmForCausalLM": "stablelm",
                          "CohereForCausalLM": "cohere", "Cohere2ForCausalLM": "cohere2", "OlmoeForCausalLM": "olmoe",
                          "Glm4MoeForCausalLM": "glm4_moe", "Dots1ForCausalLM": "dots1",
                          "MiniMaxM2ForCausalLM": "minimax_m2", "DeepseekV3ForCausalLM": "deepseek_v3",
                          "DeepseekV2ForCausalLM": "deepseek_v2", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
                          "Ministral3ForCausalLM": "ministral3", "Mistral4ForCausalLM": "mistral4",
                          "YoutuForCausalLM": "youtu", "InternLM3ForCausalLM": "internlm3",
                          "HeliumForCausalLM": "helium", "FlexOlmoForCausalLM": "flex_olmo",
                          "SolarOpenForCausalLM": "solar_open", "ExaoneMoeForCausalLM": "exaone_moe",
                          "Jais2ForCausalLM": "jais2", "VaultGemmaForCausalLM": "vaultgemma",
                          "AfmoeForCausalLM": "afmoe", "Qwen3_5ForCausalLM": "qwen3_5_text",
                          "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text", "Qwen3NextForCausalLM": "qwen3_next",
                          "Lfm2ForCausalLM": "lfm2", "Lfm2MoeForCausalLM": "lfm2_moe", "Lfm3ForCausalLM": "lfm3",
                          "OlmoHybridForCausalLM": "olmo_hybrid",
                          "GraniteMoeHybridForCausalLM": "granitemoehybrid", "BambaForCausalLM": "bamba",
                          "NemotronHForCausalLM": "nemotron_h"}
# The decoders alone, as embedding models ship them (e5-mistral: MistralModel): weights
# without the `model.` prefix and no LM head. They embed and do not generate.
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
               "Qwen3Model": "Qwen3ForCausalLM"}
# Multimodal checkpoints whose language model serves alone: its config is `text_config`, its
# weights `language_model.*`; the vision tower and projector are not loaded (a request
# with an image part is refused at the gateway, as any non-text part).
# By the text_config's model_type (its first: the default where it names none).
TEXT_MODELS_OF = {
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
    # Mistral Small 3.1 and 3.2: a Mistral behind Pixtral's vision tower
    "Mistral3ForConditionalGeneration": {"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM",
                                         "ministral3": "Ministral3ForCausalLM", "mistral4": "Mistral4ForCausalLM"},
    # Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a Qwen2 (Qwen3) whose rotary splits each head into
    # sections rotated by a token's time, height and width positions (MRoPE). A text token's
    # three positions are all its index, so on text MRoPE is the ordinary rotary.
    "Qwen2VLForConditionalGeneration": {"qwen2_vl_text": "Qwen2ForCausalLM"},
    # EXAONE 4.5: an EXAONE 4.0 behind Qwen2.5-VL's vision tower (its first releases named
    # the text model exaone4_5_text)
    "Exaone4_5_ForConditionalGeneration": {"exaone4": "Exaone4ForCausalLM", "exaone4_5_text": "Exaone4ForCausalLM"},
    "Qwen2_5_VLForConditionalGeneration": {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
    "Qwen3VLForConditionalGeneration": {"qwen3_vl_text": "Qwen3ForCausalLM"},
    # Qwen3-VL-MoE (30B-A3B, 235B-A22B): a Qwen3-MoE, its experts stacked in the checkpoint
    "Qwen3VLMoeForConditionalGeneration": {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
    # Qwen3.5 (0.8B to 397B-A17B): every size ships with its vision tower; on text its
    # interleaved MRoPE is the ordinary rotary, as Qwen3-VL's
    "Qwen3_5ForConditionalGeneration": {"qwen3_5_text": "Qwen3_5ForCausalLM"},
    "Qwen3_5MoeForConditionalGeneration": {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"},
}
# What a text config's class leaves out that its model does: Qwen3-VL-MoE's router always
# renormalizes the chosen experts' weights (its config's norm_topk_prob is unset)
TEXT_CONFIG_AS_RUN = {"qwen3_vl_moe_text": {"norm_topk_prob": True}}
# transformers' names for the MLP's gate activation (a gated MLP's), and those of an MLP
# without a gate, by family: relu2 (ReLU squared), gelu_new (GPT-2's tanh form, as its code
# computes it)
GATED_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
_LAYER_NORMED_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
UNGATED = {"ArceeForCausalLM": ("relu2",), "NemotronHForCausalLM": ("relu2",), "ApertusForCausalLM": ("xielu",), "Jais2ForCausalLM": ("relu2",),
           **dict.fromkeys(("OPTForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "PhiForCausalLM",
                            "Starcoder2ForCausalLM"), _LAYER_NORMED_ACTS)}
HIDDEN_ACTS = tuple(dict.fromkeys((*GATED_ACTS, *(a for acts in UNGATED.values() for a in acts))))


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama with attention_bias
    o_bias: bool  # Llama with attention_bias only
    mlp_bias: bool = False  # Llama's mlp_bias, ERNIE's use_bias: gate/up and down biased
    gated_mlp: bool = True  # False (Arcee): the MLP is down(act(up x)), its gate_up_proj the up rows alone
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., ...}; empty = default
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # A sliding window this family's loader does not implement (a Llama config's): the
    # context stops at the window. Mistral's, Qwen's and Gemma's are: `layer_windows`.
    sliding_window: int | None = None
    # Each layer's attention window (a query sees the keys of its last `window` positions,
    # itself included, as transformers' sliding-window mask; 0: every earlier key); empty
    # when no layer is windowed.
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: the windowed layers rotate with this base (default rope), the others with
    # rope_theta and rope_scaling. None: every layer alike.
    local_rope_theta: float | None = None
    # Gemma 2's soft caps, cap * tanh(x / cap): on every attention score (after the scale)
    # and on the logits. None: no cap.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 2: a norm on the attention's output and on the MLP's output too, before each
    # joins the residual stream (post_attention_layernorm, post_feedforward_layernorm), the
    # MLP's input normed by pre_feedforward_layernorm.
    sandwich_norms: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head (q_norm, k_norm)
    # OLMo 2: the query and key norms span all heads of a token at once, not each head
    qk_norm_over_heads: bool = False
    # Hunyuan: the query and key norms after rotary, not before it
    qk_norm_after_rope: bool = False
    # False (OLMo 2): no norm before attention and the MLP, only the output norms of
    # sandwich_norms (post_attention_layernorm, post_feedforward_layernorm)
    pre_norms: bool = True
    rotary_dim: int = 0  # the leading dims of a head that rotate (partial_rotary_factor); 0 = all
    # longrope: a sequence longer than this (original_max_position_embeddings) rotates with
    # the long factors from its first token, as transformers' Phi-3 recomputes it there
    long_rope_threshold: int | None = None
    # Mixture of experts: `moe_layers` are sparse, each token going to `num_experts_per_tok`
    # of `num_experts` experts of `moe_intermediate_size`, weighed by the router's softmax
    # over the chosen ones (norm_topk_prob) or over all experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # GraniteMoe: the k chosen experts weighed by a softmax over their logits alone (the same
    # numbers as the renormalized softmax, by its own arithmetic, as transformers runs it)
    moe_topk_softmax: bool = False
    moe_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a dense expert every token takes (0: none), weighed by sigmoid(gate . x)
    # (GLM-4.5's shared experts, one MLP of their summed size: unweighed, shared_expert_gated off)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    # A router whose choice is by score + a learned correction bias ("": none): GLM-4.5's
    # (DeepSeek-V3's) "sigmoid" scores, chosen within the best `moe_topk_groups` of
    # `moe_num_groups` groups of experts (a group by its two best), the chosen scores
    # renormalized (norm_topk_prob) and scaled; ERNIE 4.5's "softmax", its renormalizing
    # sum floored at `moe_norm_min`
    moe_score_correction: str = ""
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    moe_norm_min: float = 0.0
    moe_norm_eps: float = 1e-20  # added to the renormalizing sum (DeepSeek-V3's 1e-20; LFM2-MoE's 1e-6)
    # AFMoE's: the attention's output times sigmoid(gate_proj(x)) of the layer's input x,
    # before o_proj
    attention_gate: bool = False
    # LFM3's: one gate a head (gate_proj [heads, hidden]), each head's output times its sigmoid
    attention_gate_per_head: bool = False
    moe_router_float32: bool = False  # Hunyuan MoE's, ERNIE's: the router's weights kept float32 (its product is)
    # DeepSeek-V2's router: the choice by its softmax scores alone (no correction bias:
    # moe_score_correction names the scoring), groups ranked by their best expert
    moe_correction_bias: bool = True
    moe_group_by_max: bool = False
    # Layers a checkpoint holds past num_hidden_layers (GLM-4.5's multi-token prediction),
    # skipped at load
    skipped_layers: int = 0
    # Multi-head latent attention where kv_lora_rank > 0 (DeepSeek-V3's:
    # layers/latent_attention.py): keys and values from a kv_lora_rank latent a token,
    # queries through a q_lora_rank one (0: one projection), each query head's
    # qk_nope_head_dim unrotated dims and qk_rope_head_dim rotating ones, values of
    # v_head_dim. head_dim and num_key_value_heads then describe the cache's one latent
    # head (kv_lora_rank + qk_rope_head_dim wide), attention_scale the softmax's.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Ministral 3's and Mistral 4's queries times 1 + beta * log(1 + floor(position / original))
    # (the rope config's llama_4_scaling_beta; 0: none): layers/query_scale.py
    query_scale_beta: float = 0.0
    query_scale_original: int = 0
    # A checkpoint in FP8 with block scales: its block (rows, columns), the weights widened
    # at load (models/checkpoints/fp8_weights.py); () for any other
    fp8_weight_block: tuple[int, ...] = ()
    # A checkpoint of AWQ's or compressed-tensors' integer weights with group scales, widened
    # at load (models/checkpoints/quantized_weights.py); None for any other
    quantized_weights: QuantizedWeights | None = None
    # Granite's scalars; a Llama's are the identity (attention_scale None: 1/sqrt(head_dim)).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    # Gemma's embedding scale is rounded to the activations' dtype before it multiplies
    # (transformers casts it so), Granite's multiplies as the float it is.
    embedding_multiplier_in_dtype: bool = False
    hidden_act: str = "silu"  # one of HIDDEN_ACTS
    norm_weight_offset: float = 0.0  # Gemma: its norms weigh by (offset + weight), offset 1
    nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose queries and keys do not rotate
    # GLM: rotary turns interleaved pairs of dims; the loader reorders the query and key rows
    # to the rotate-half layout (rotary.interleaved_as_halves)
    rotary_interleaved: bool = False
    # A sequence classifier's classes (shared/hf/classification.py): its score head's rows, in
    # place of an LM head; 0: not a classifier
    num_labels: int = 0
    # The LayerNorm decoders (LAYER_NORMED): LayerNorm (mean and variance, a bias where
    # norm_bias) in place of RMSNorm, with rms_norm_eps as its eps
    layer_norm: bool = False
    norm_bias: bool = False
    # GPT-NeoX, Phi: attention and MLP read the same residual and both outputs join it at
    # once; Phi's MLP reads the attention's normed input (shared_norm), NeoX's its own norm
    parallel_residual: bool = False
    shared_norm: bool = False
    # GPT-2, OPT: a learned table of absolute positions (this many rows, a position's row
    # `position_offset` further on) added to the embeddings; their layers do not rotate
    position_embeddings: int = 0
    position_offset: int = 0
    lm_head_bias: bool = False  # Phi
    # OPT: queries scaled by 1/sqrt(head_dim) after their projection, the scores then
    # unscaled (transformers' order of roundings)
    scale_queries: bool = False
    # StableLM's and Cohere's parallel sum, residual + attention + MLP in that order (NeoX's
    # and Phi's: MLP and attention, then the residual): the same numbers, other roundings
    residual_first: bool = False
    # gpt-oss: a learned logit per query head (`sinks`) that joins each row's softmax as one
    # more column, and is dropped after it: a share of attention that goes to no value
    attention_sinks: bool = False
    # gpt-oss's experts and router are biased; its experts gate with a clamped SwiGLU:
    # gate at most limit, up within +-limit, (up + 1) * gate * sigmoid(alpha * gate)
    moe_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # Hybrids: the layers whose token mixer keeps a recurrent state a request in place of a
    # KV cache, and which mixer: "gated_delta_net" (Qwen3.5's linear attention:
    # layers/gated_delta_net.py; its key and value heads and the width of its causal
    # convolution below), "short_conv" (LFM2's: layers/short_conv.py) or "mamba2"
    # (Granite 4.0-H's: layers/mamba2.py)
    recurrent_layers: tuple[int, ...] = ()
    recurrent_mixer: str = ""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # OLMo Hybrid's: beta times 2 (linear_allow_neg_eigval: the state's eigenvalues down to
    # -1), its output norm's own eps (0: rms_norm_eps)
    linear_beta_scale: float = 1.0
    linear_norm_eps: float = 0.0
    # Layers normed as OLMo 2's (each branch's output, not its input) in a model whose other
    # layers are normed as a Llama's: OLMo Hybrid's attention layers
    post_normed_layers: tuple[int, ...] = ()
    short_conv_kernel: int = 0
    short_conv_bias: bool = False
    # Mamba2's: heads of head_dim over a state of state_size, B and C shared by groups of
    # heads, its convolution's width, biases, and the limits its time steps are clamped to
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_num_groups: int = 1
    mamba_conv_kernel: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_limit: tuple[float, float] = (0.0, math.inf)

    # Nemotron-H's blocks of one branch: its MLP alone (no token mixer, no cache) or its
    # token mixer alone (no MLP)
    mixerless_layers: tuple[int, ...] = ()
    mlpless_layers: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend over a KV cache (all but a hybrid's recurrent ones and
        the layers without a token mixer)."""
        other = {*self.recurrent_layers, *self.mixerless_layers}
        return tuple(i for i in range(self.num_hidden_layers) if i not in other)

    @property
    def rotary_head_dim(self) -> int:
        """The width a rotary table is built for: a head's (its leading rotary_dim rotating),
        or latent attention's rotating dims alone."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def max_model_len(self) -> int:
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} is not a model folder: it has no config.json")
        raw = json.loads(path.read_text(), object_hook=_tagged_float)
        # (a quantization neither reads refused here, by its method)
        quantized_weights, fp8_block = quantized_weight_format(raw), fp8_weight_block(raw)
        multimodal = next((a for a in raw.get("architectures") or [] if a in TEXT_MODELS_OF), None)
        if multimodal is not None:
            raw = _text_config(raw, TEXT_MODELS_OF[multimodal])
        # A sequence classifier: the decoder of its family, a score head in place of the LM head
        archs = [BASE_MODELS.get(a, a.removesuffix(SUFFIX) + "ForCausalLM" if a.endswith(SUFFIX) else a)
                 for a in raw.get("architectures") or []]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted([*SUPPORTED_ARCHITECTURES, *BASE_MODELS]))} (and each family's "
                f"{SUFFIX})"
            )
        if arch in UNCLASSIFIED and is_classifier(raw):
            raise ValueError(f"unsupported architecture {raw['architectures'][0]!r}: the {arch} family generates; "
                             f"its {SUFFIX} is not served")
        if arch in FILLED_BY_TRANSFORMERS:
            raw = _filled(raw, FILLED_BY_TRANSFORMERS[arch])
        if arch in LAYER_NORMED:
            raw = _layer_normed(arch, raw)
        if arch == "Qwen3_5MoeForCausalLM":  # (every layer sparse: its config names no dense MLP's size)
            raw = {**raw, "intermediate_size": raw.get("intermediate_size") or raw["moe_intermediate_size"]}
        if arch in SHORT_CONVS:
            raw = _lfm2(raw)
        if arch == GRANITE_HYBRID and not raw.get("num_local_experts"):  # (dense: its shared MLP is the MLP)
            raw = {**raw, "intermediate_size": raw["shared_intermediate_size"]}
        if arch == "NemotronHForCausalLM":
            raw = _nemotron_h(raw)
        local_rope_theta = None
        if arch == "Gemma3ForCausalLM" and raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (an embedding Gemma 3) is not supported: a causal decoder only")
        if arch in ROPES_BY_LAYER_TYPE:
            raw, local_rope_theta = _ropes_by_layer_type(raw)
        # Gemma 2's config names it hidden_activation (Gemma's carries both, hidden_act first)
        hidden_act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
        if arch in GEMMAS and hidden_act == "gelu":
            # Gemma's first releases say "gelu" and mean the tanh approximation (transformers
            # and vLLM read it so)
            hidden_act = "gelu_pytorch_tanh"
        if hidden_act not in UNGATED.get(arch, GATED_ACTS):
            raise ValueError(f"unsupported hidden_act {hidden_act!r} for {arch}: "
                             f"{', '.join(UNGATED.get(arch, GATED_ACTS))}")
        heads = raw["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta`
        # beside an optional `rope_scaling`.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
        beta = rope.pop("llama_4_scaling_beta", None)  # (read by the families whose transformers class reads it)
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        if arch in HUNYUANS and rope_type == "dynamic" and rope.get("alpha"):
            # Hunyuan's NTK alpha: a fixed, larger base (transformers' ntk_alpha), whatever the length
            theta = theta * rope.pop("alpha") ** (head_dim / (head_dim - 2))
        if rope_type == "dynamic":
            # Dynamic NTK (InternLM3's): transformers raises the base only for a sequence past
            # max_position_embeddings, and at that length or under its factor leaves the
            # default frequencies bit for bit; llmbus never serves past it (max_model_len).
            # (Hunyuan's alpha, a fixed base whatever the length, is in theta by now.)
            rope = {"rope_type": "default"}
            rope_type = "default"
        if rope_type not in ("default", "linear", "llama3", "longrope", "yarn", "proportional"):
            raise ValueError(f"unsupported rope_type {rope_type!r}: default, linear, llama3, yarn, longrope or "
                             "proportional")
        rope["rope_type"] = rope_type
        # Qwen-VL's MRoPE: on text, the ordinary rotary (TEXT_MODELS_OF), its sections unread
        for key in ("type", "mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        # proportional (LFM3's full layers): every dim turns, the frequencies past
        # partial_rotary_factor's share zero (layers/rotary.py), so its factor stays with them
        partial = 1.0 if rope_type == "proportional" else rope.pop("partial_rotary_factor",
                                                                     raw.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"unsupported partial_rotary_factor {partial}: {rotary_dim} of {head_dim} dims rotate")
        long_rope_threshold = None
        if rope_type == "longrope":
            original = rope.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
            if original is None or len(rope.get("short_factor", ())) != rotary_dim // 2 \
                    or len(rope.get("long_factor", ())) != rotary_dim // 2:
                raise ValueError("longrope needs original_max_position_embeddings and short_factor and "
                                 f"long_factor of {rotary_dim // 2} values each")
            rope["original_max_position_embeddings"] = long_rope_threshold = original
            # transformers' attention factor: from `factor`, or the ratio of the two lengths
            rope.setdefault("factor", raw.get("max_position_embeddings", 2048) / original)
        if rope_type == "yarn":  # as transformers standardizes it: the pretrained length, the factor from it
            original = raw.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
                or raw.get("max_position_embeddings", 2048)
            rope["original_max_position_embeddings"] = original
            if rope.get("factor") is None:
                rope["factor"] = raw.get("max_position_embeddings", 2048) / original
        latent = _latent_attention_fields(arch, raw, rope)
        if latent:  # the cache's one latent head; the rotary over the rotating dims alone
            head_dim, rotary_dim = latent["kv_lora_rank"] + latent["qk_rope_head_dim"], 0
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):  # several EOS ids: the first is the one we stop on
            eos = eos[0] if eos else None
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=1 if latent else raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            # transformers' default where config.json leaves it out: Gemma's config ties
            tie_word_embeddings=raw.get("tie_word_embeddings", arch in GEMMAS),
            qkv_bias=(arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and raw.get("qkv_bias", True))
                      or raw.get("attention_bias", False) or raw.get("use_bias", False)),
            o_bias=(raw.get("attention_out_bias", False) if arch == "SeedOssForCausalLM" else
                    arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "StableLmForCausalLM", *GLMS,
                                 "Glm4MoeForCausalLM", "HeliumForCausalLM", "SolarOpenForCausalLM")
                    and (raw.get("attention_bias", False) or raw.get("use_bias", False))),
            mlp_bias=bool(raw.get("mlp_bias", False) or raw.get("use_bias", False)),
            gated_mlp=arch not in UNGATED,
            rope_scaling=rope,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            sliding_window=(raw.get("sliding_window") if raw.get("use_sliding_window", True)
                            and arch not in WINDOWED else None),
            local_rope_theta=local_rope_theta,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", *POST_NORMED, "OlmoeForCausalLM",
                             *LINEAR_ATTENTION, OLMO_HYBRID, *SHORT_CONVS,
                             *HUNYUANS, "ApertusForCausalLM", "Dots1ForCausalLM", "MiniMaxM2ForCausalLM",
                             "ExaoneMoeForCausalLM", "AfmoeForCausalLM")
            or (arch == "Glm4MoeForCausalLM" and bool(raw.get("use_qk_norm"))),
            qk_norm_after_rope=arch in HUNYUANS,
            attention_sinks=arch == "GptOssForCausalLM",
            qk_norm_over_heads=arch in QK_NORMS_OVER_HEADS,
            pre_norms=arch not in POST_NORMED,
            rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
            long_rope_threshold=long_rope_threshold,
            **_moe_fields(arch, raw),
            hidden_act=hidden_act,
            **_granite_fields(arch, raw),
            **_gemma_fields(arch, raw),
            **({"sandwich_norms": True} if arch in (*POST_NORMED, "Glm4ForCausalLM", "AfmoeForCausalLM", "Lfm3ForCausalLM")
               else {}),
            attention_gate=arch in ("AfmoeForCausalLM", *LINEAR_ATTENTION) or bool(
                arch == "Lfm3ForCausalLM" and raw.get("use_attention_gate", True)),
            attention_gate_per_head=arch == "Lfm3ForCausalLM",
            **({"embedding_multiplier": raw["hidden_size"] ** 0.5} if arch == "AfmoeForCausalLM" and raw.get("mup_enabled")
               else {}),
            rotary_interleaved=arch in (*GLMS, "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", *COHERES, "HeliumForCausalLM")
            or (arch in LATENT_ATTENTION and bool(raw.get("rope_interleave", True))),
            **_sliding_window_fields(arch, raw),
            nope_layers=_nope_layers(arch, raw),
            num_labels=num_labels(raw) if is_classifier(raw) else 0,
            **_layer_normed_fields(arch, raw),
            **latent,
            fp8_weight_block=fp8_block or (),
            quantized_weights=quantized_weights,
            **_query_scale_fields(arch, beta, rope),
            **_linear_attention_fields(arch, raw),
            **_short_conv_fields(arch, raw),
            **_mamba_fields(arch, raw),
        )


def _nemotron_h(raw: dict) -> dict:
    """Nemotron-H's config (transformers' NemotronHConfig, defaults filled in, its blocks
    by layers_block_type: linear_attention for Mamba2, full_attention, mlp, moe) in the
    names the rest of this reader takes: Granite 4.0-H's for Mamba2, its MLP's activation,
    its norms' eps. Its mixture-of-experts blocks (Nemotron 3) are refused by name."""
    kinds = raw.get("layers_block_type") or raw["layer_types"]
    if "moe" in kinds:
        raise ValueError("unsupported Nemotron-H mixture-of-experts blocks (moe in layers_block_type, Nemotron 3): "
                         "Mamba2, attention and MLP blocks only")
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported mamba_hidden_act {raw['mamba_hidden_act']!r} for Nemotron-H: silu")
    heads, head_dim = raw["mamba_num_heads"], raw["mamba_head_dim"]
    return {**raw, "layer_types": list(kinds), "num_hidden_layers": len(kinds), "hidden_act": raw.get("mlp_hidden_act", "relu2"),
            "rms_norm_eps": raw["layer_norm_epsilon"], "mamba_n_heads": heads, "mamba_d_head": head_dim,
            "mamba_expand": heads * head_dim / raw["hidden_size"], "mamba_d_state": raw["ssm_state_size"],
            "mamba_n_groups": raw["n_groups"], "mamba_d_conv": raw["conv_kernel"],
            "mamba_conv_bias": raw.get("use_conv_bias", True),
            "mamba_proj_bias": raw.get("mamba_proj_bias", raw.get("use_bias", False))}


def _mamba_fields(arch: str, raw: dict) -> dict:
    """Granite 4.0-H's and Bamba's hybrid layers (transformers' GraniteMoeHybridConfig,
    BambaConfig, defaults filled in, layer_types standardized: "mamba" read as
    linear_attention; Bamba's from attn_layer_indices): Mamba2 mixers where
    linear_attention, attention elsewhere."""
    if arch not in MAMBAS:
        return {}
    num_layers = raw["num_hidden_layers"]
    attending = set(raw.get("attn_layer_indices") or ())
    kinds = raw.get("layer_types") or ["full_attention" if i in attending else "linear_attention"
                                       for i in range(num_layers)]
    blocks = arch == "NemotronHForCausalLM"  # (a block of one branch each: an MLP block among them)
    _check_layer_kinds(kinds, num_layers, {"linear_attention", "full_attention", *(["mlp"] * blocks)})
    heads, head_dim, groups = raw["mamba_n_heads"], raw["mamba_d_head"], raw["mamba_n_groups"]
    if heads * head_dim != raw["mamba_expand"] * raw["hidden_size"] or heads % groups or raw["mamba_d_conv"] < 2:
        raise ValueError(f"unsupported Mamba2 dims: {heads} heads of {head_dim} (mamba_expand * hidden_size "
                         f"{raw['mamba_expand'] * raw['hidden_size']}), {groups} groups, a convolution "
                         f"{raw['mamba_d_conv']} wide")
    limit = tuple(float(x) for x in (raw.get("time_step_limit") or (0.0, math.inf)))
    one_branch = dict(mixerless_layers=tuple(i for i, kind in enumerate(kinds) if kind == "mlp"),
                      mlpless_layers=tuple(i for i, kind in enumerate(kinds) if kind != "mlp")) if blocks else {}
    return dict(one_branch, recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
                recurrent_mixer="mamba2", mamba_num_heads=heads, mamba_head_dim=head_dim,
                mamba_state_size=raw["mamba_d_state"], mamba_num_groups=groups, mamba_conv_kernel=raw["mamba_d_conv"],
                mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
                mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)), mamba_dt_limit=limit)


def _check_layer_kinds(kinds: list[str], num_layers: int, allowed: set[str]) -> None:
    """A hybrid's layer_types: one of `allowed` for each layer."""
    if len(kinds) != num_layers or not set(kinds) <= allowed:
        raise ValueError(f"layer_types must name {' or '.join(sorted(allowed))} for each of {num_layers} layers")


def _tagged_float(obj: dict):
    """transformers 5 writes the floats JSON has no literal for as {"__float__": "Infinity"}
    (Granite 4.0-H's time_step_limit), and reads them back so."""
    tag = obj.get("__float__") if len(obj) == 1 else None
    return {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}.get(tag, obj) if isinstance(tag, str) else obj


def _lfm2(raw: dict) -> dict:
    """LFM2's config (transformers' Lfm2Config, defaults filled in) in the names the rest of
    this reader takes: its norms' eps, and its MLP's size as its class computes it from
    intermediate_size (two thirds of it, times block_ffn_dim_multiplier, rounded up to
    block_multiple_of)."""
    size = raw["intermediate_size"]
    if raw.get("block_auto_adjust_ff_dim"):
        size = int(2 * size / 3)
        if raw.get("block_ffn_dim_multiplier") is not None:
            multiple = raw["block_multiple_of"]
            size = multiple * ((int(raw["block_ffn_dim_multiplier"] * size) + multiple - 1) // multiple)
    return {**raw, "intermediate_size": size, "rms_norm_eps": raw["norm_eps"]}


def _short_conv_fields(arch: str, raw: dict) -> dict:
    """LFM2's hybrid layers: a gated short convolution where `layer_types` says conv, full
    attention (Qwen3's per-head query/key norms) elsewhere."""
    if arch not in SHORT_CONVS:
        return {}
    kinds = raw["layer_types"]
    lfm3 = arch == "Lfm3ForCausalLM"
    _check_layer_kinds(kinds, raw["num_hidden_layers"], {"conv", "full_attention", *(("sliding_attention",) if lfm3 else ())})
    if raw["conv_L_cache"] < 2:
        raise ValueError(f"unsupported conv_L_cache {raw['conv_L_cache']}: a convolution at least 2 wide")
    if lfm3 and not raw.get("use_sandwich_norm", True):
        raise ValueError("unsupported use_sandwich_norm false for LFM3: its four norms a layer only")
    window = raw.get("sliding_window") if lfm3 else None
    if "sliding_attention" in kinds and not (window and window >= 1):
        raise ValueError(f"sliding_window {window} must be at least 1 for LFM3's sliding layers")
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds) if window else ()
    return dict(recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "conv"),
                recurrent_mixer="short_conv", short_conv_kernel=int(raw["conv_L_cache"]),
                short_conv_bias=bool(raw.get("conv_bias")),
                **({"layer_windows": windows} if any(windows) else {}))


def _linear_attention_fields(arch: str, raw: dict) -> dict:
    """Qwen3.5's hybrid layers (transformers' Qwen3_5TextConfig, defaults filled in): the
    Gated DeltaNet where `layer_types` says linear_attention, full attention elsewhere,
    its heads' outputs gated by half of q_proj's rows (attention_gate), Qwen3's per-head
    query/key norms (qk_norm), Gemma's 1 + w norms. OLMo Hybrid's (transformers'
    OlmoHybridConfig): the same layers, as many key heads as value heads, beta up to 2
    where linear_allow_neg_eigval, the output norm's eps 1e-5, its attention layers normed
    as OLMo 2's (post_normed_layers) and the others as a Llama's, plain w norms."""
    if arch not in (*LINEAR_ATTENTION, OLMO_HYBRID):
        return {}
    kinds = raw["layer_types"]
    _check_layer_kinds(kinds, raw["num_hidden_layers"], {"linear_attention", "full_attention"})
    fields = {k: int(raw[k]) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim", "linear_conv_kernel_dim")}
    if min(fields.values()) < 1 or fields["linear_num_value_heads"] % fields["linear_num_key_heads"] \
            or fields["linear_conv_kernel_dim"] < 2:
        raise ValueError(f"unsupported linear attention dims {fields}: value heads a multiple of key heads, "
                         "a convolution at least 2 wide")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} for {arch}: silu")
    if raw.get("attention_bias"):  # (q_proj's bias would be split between queries and gates)
        raise ValueError(f"unsupported attention_bias true for {arch}: attention without biases only")
    recurrent = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    if arch == OLMO_HYBRID:
        if fields["linear_num_key_heads"] != fields["linear_num_value_heads"]:
            raise ValueError(f"unsupported linear attention heads {fields}: OLMo Hybrid's as many key heads as value "
                             "heads (its transformers class pairs them one to one)")
        return dict(fields, recurrent_layers=recurrent, recurrent_mixer="gated_delta_net",
                    linear_beta_scale=2.0 if raw.get("linear_allow_neg_eigval", True) else 1.0, linear_norm_eps=1e-5,
                    post_normed_layers=tuple(i for i, kind in enumerate(kinds) if kind == "full_attention"))
    return dict(fields, recurrent_layers=recurrent, recurrent_mixer="gated_delta_net", norm_weight_offset=1.0)


def _query_scale_fields(arch: str, beta: float | None, rope: dict) -> dict:
    """Ministral 3's and Mistral 4's Llama 4 temperature: its beta, and the pretrained
    context it is counted in (the rope config's original_max_position_embeddings)."""
    if arch not in QUERIES_SCALED_BY_POSITION or not beta:
        return {}
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise ValueError(f"llama_4_scaling_beta {beta} for {arch} needs the rope config's "
                         "original_max_position_embeddings")
    return dict(query_scale_beta=float(beta), query_scale_original=int(original))


def _latent_attention_fields(arch: str, raw: dict, rope: dict) -> dict:
    """DeepSeek-V3's latent attention (transformers' DeepseekV3Attention): its dims, and
    its softmax scale, 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's mscale
    (of mscale_all_dim) squared, as transformers' yarn_apply_mscale makes it."""
    if arch not in LATENT_ATTENTION:
        return {}
    if raw.get("attention_bias"):
        raise ValueError(f"unsupported attention_bias true for {arch}: latent attention without biases only")
    dims = {k: int(raw[k] or 0) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim")}
    if min(dims["kv_lora_rank"], dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"]) < 1 \
            or dims["qk_rope_head_dim"] % 2:
        raise ValueError(f"unsupported latent attention dims {dims}: every one positive, qk_rope_head_dim even")
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    factor, m_all = rope.get("factor") or 1.0, rope.get("mscale_all_dim")
    if rope.get("rope_type", "default") != "default" and m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return dict(dims, attention_scale=scale)


def _layer_normed(arch: str, raw: dict) -> dict:
    """A LayerNorm decoder's config (as its transformers class fills it in) in the names the
    rest of this reader takes, where they differ; what the loader would mishandle refused."""
    raw = dict(raw)
    if arch == "GPT2LMHeadModel":
        for flag, runs in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            if bool(raw.get(flag, runs)) != runs:
                raise ValueError(f"unsupported {flag} {raw.get(flag)!r} for GPT-2: {runs} only")
        raw.update(hidden_size=raw["n_embd"], num_hidden_layers=raw["n_layer"], num_attention_heads=raw["n_head"],
                   intermediate_size=raw.get("n_inner") or 4 * raw["n_embd"],
                   max_position_embeddings=raw["n_positions"], hidden_act=raw["activation_function"],
                   layer_norm_eps=raw["layer_norm_epsilon"])
    elif arch == "OPTForCausalLM":
        if not raw.get("do_layer_norm_before", True) or raw.get("_remove_final_layer_norm"):
            raise ValueError("unsupported OPT layer norms after each branch (do_layer_norm_before false: opt-350m): "
                             "before only")
        if raw.get("word_embed_proj_dim", raw["hidden_size"]) != raw["hidden_size"]:
            raise ValueError(f"unsupported OPT word_embed_proj_dim {raw['word_embed_proj_dim']} (projected "
                             f"embeddings: opt-350m): the hidden size {raw['hidden_size']} only")
        if not raw.get("layer_norm_elementwise_affine", True):
            raise ValueError("unsupported OPT layer_norm_elementwise_affine false: norms with weights only")
        raw.update(intermediate_size=raw["ffn_dim"], hidden_act=raw["activation_function"], layer_norm_eps=1e-5,
                   attention_bias=raw.get("enable_bias", True))
    elif arch in ("PhiForCausalLM", "StableLmForCausalLM") and raw.get("qk_layernorm"):
        raise ValueError(f"unsupported qk_layernorm true for {arch}: without query/key norms only")
    elif arch == "CohereForCausalLM" and raw.get("use_qk_norm"):
        raise ValueError("unsupported use_qk_norm true for Cohere (Command R+): without query/key norms only")
    raw["rms_norm_eps"] = raw.get("layer_norm_eps", raw.get("norm_epsilon", 1e-5))  # (the norms' eps, whatever the norm)
    if arch in ("OPTForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM"):
        # a head of keys and values to each query head, of hidden / heads dims, whatever
        # else the file holds
        raw["num_key_value_heads"] = raw["num_attention_heads"]
        raw.pop("head_dim", None)
    if arch == "OPTForCausalLM":  # (its enable_bias says for both)
        raw["mlp_bias"] = raw["attention_bias"]
    elif arch == "Starcoder2ForCausalLM":
        raw["attention_bias"] = raw["mlp_bias"] = raw.get("use_bias", True)
    elif arch == "StableLmForCausalLM":  # q/k/v's bias alone (o_proj never: attention_out_bias)
        raw["attention_bias"], raw["mlp_bias"] = bool(raw.get("use_qkv_bias")), False
    elif arch in COHERES:
        raw["mlp_bias"] = False
    elif arch == "Jais2ForCausalLM":  # (as its config says: both biased by default)
        raw["attention_bias"], raw["mlp_bias"] = bool(raw.get("attention_bias", True)), bool(raw.get("mlp_bias", True))
    else:  # (the MLPs of GPT-2, NeoX and Phi are always biased)
        raw["attention_bias"] = raw.get("attention_bias", True) if arch == "GPTNeoXForCausalLM" else True
        raw["mlp_bias"] = True
    return raw


def _layer_normed_fields(arch: str, raw: dict) -> dict:
    if arch not in LAYER_NORMED:
        return {}
    biased = bool(raw.get("enable_bias", True)) if arch == "OPTForCausalLM" else arch not in COHERES
    parallel = (arch in ("PhiForCausalLM", *COHERES)
                or (arch in ("GPTNeoXForCausalLM", "StableLmForCausalLM")
                    and raw.get("use_parallel_residual", arch == "GPTNeoXForCausalLM")))
    fields = dict(layer_norm=True, norm_bias=biased, parallel_residual=parallel,
                  shared_norm=parallel and arch != "GPTNeoXForCausalLM", lm_head_bias=arch == "PhiForCausalLM",
                  scale_queries=arch == "OPTForCausalLM",
                  # StableLM's and Cohere's sum: the residual and the attention first, then the MLP
                  residual_first=parallel and arch in ("StableLmForCausalLM", *COHERES))
    if arch in COHERES:
        scale = float(raw.get("logit_scale", 1.0))
        if scale == 0:
            raise ValueError("logit_scale must not be 0")
        fields["logits_scaling"] = 1.0 / scale
    if arch in LEARNED_POSITIONS:
        offset = LEARNED_POSITIONS[arch]
        fields.update(position_embeddings=raw["max_position_embeddings"] + offset, position_offset=offset)
    return fields


def _filled(raw: dict, model_type: str) -> dict:
    """config.json with what it leaves out as transformers' config class fills it in."""
    from transformers import CONFIG_MAPPING

    given = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    from huggingface_hub.errors import StrictDataclassError

    try:
        filled = CONFIG_MAPPING[model_type](**given).to_dict()
    except (TypeError, ValueError, StrictDataclassError) as exc:  # (transformers 5's configs check their fields)
        raise ValueError(f"config.json does not read as transformers' {model_type} config: {exc}") from exc
    return {**filled, "architectures": raw.get("architectures")}


def _nope_layers(arch: str, raw: dict) -> tuple[int, ...]:
    """SmolLM3's no_rope_layers: a 1 for each layer that rotates, a 0 for each that does not.
    EXAONE 4's global layers, where it has windowed ones (transformers rotates only those)."""
    if arch in LEARNED_POSITIONS:  # their positions are learned: no layer rotates
        return tuple(range(raw["num_hidden_layers"]))
    if arch in EXAONES and raw.get("sliding_window"):
        return tuple(i for i, kind in enumerate(raw["layer_types"]) if kind == "full_attention")
    if (arch == GRANITE_HYBRID and raw.get("position_embedding_type") != "rope") or arch == "NemotronHForCausalLM":
        # (Granite 4.0-H's attention, and Nemotron-H's: NoPE)
        return tuple(range(raw["num_hidden_layers"]))
    if arch == OLMO_HYBRID and (raw.get("rope_parameters") or {}).get("rope_theta") is None:
        return tuple(range(raw["num_hidden_layers"]))  # (no rope theta: none rotates, as its class)
    if arch == "AfmoeForCausalLM":  # only a windowed layer rotates, window or not
        return tuple(i for i, kind in enumerate(raw["layer_types"]) if kind == "full_attention")
    if arch == "Cohere2ForCausalLM":  # only a windowed layer rotates: without a window, none
        window = raw.get("sliding_window")
        return tuple(i for i, kind in enumerate(raw["layer_types"]) if kind == "full_attention" or not window)
    if arch != "SmolLM3ForCausalLM":
        return ()
    flags = raw["no_rope_layers"]
    if len(flags) < raw["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers must name each of {raw['num_hidden_layers']} layers, got {len(flags)}")
    return tuple(i for i in range(raw["num_hidden_layers"]) if not flags[i])


def _text_config(raw: dict, text_models: dict[str, str]) -> dict:
    """A multimodal config's language model, as a config of its own, read as transformers
    reads it: through the outer config class, whose `text_config` fills in what the file
    leaves out (gemma-3-4b-it's names 6 keys) or, where the file has none (Qwen2.5-VL's
    first releases), is built from the outer config's own keys."""
    from transformers import CONFIG_MAPPING

    architecture = raw["architectures"][0]
    given = raw.get("text_config") or {}
    try:
        outer = CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items()
                                                     if k not in ("model_type", "transformers_version")})
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"unsupported text_config model_type {given.get('model_type')!r} in {architecture}: "
                         f"{', '.join(text_models)} ({exc})") from exc
    full = outer.get_text_config().to_dict()
    if full["model_type"] not in text_models:
        raise ValueError(f"unsupported text_config model_type {full['model_type']!r} in {architecture}: "
                         f"{', '.join(text_models)}")
    full.update(TEXT_CONFIG_AS_RUN.get(full["model_type"], {}))
    for key in ("bos_token_id", "eos_token_id"):  # Gemma's checkpoints put the ids beside text_config
        if raw.get(key) is not None:
            full[key] = raw[key]
    # Whether the LM head is the embedding is the outer config's say, its class's default
    # where the file is silent (Gemma 3's ties, Qwen-VL's does not): transformers ties by
    # it, whatever text_config holds.
    full["tie_word_embeddings"] = outer.tie_word_embeddings
    return {**full, "architectures": [text_models[full["model_type"]]]}


def _sliding_window_fields(arch: str, raw: dict) -> dict:
    """Mistral's, Mixtral's and Phi-3's window on every layer; Qwen's where
    `use_sliding_window` says, on the layers from `max_window_layers` on (or as
    `layer_types` names them): as transformers applies them."""
    window, num_layers = raw.get("sliding_window"), raw["num_hidden_layers"]
    if arch in EVERY_LAYER_WINDOWED and window:
        return dict(layer_windows=_layer_windows(["sliding_attention"] * num_layers, window, num_layers))
    if arch in ALWAYS_BY_LAYER_TYPE and window:  # windowed where layer_types says, always
        return dict(layer_windows=_layer_windows(raw["layer_types"], window, num_layers))
    if arch in BY_LAYER_TYPE and window and raw.get("use_sliding_window"):
        first = raw.get("max_window_layers", num_layers)
        kinds = raw.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(num_layers)]
        return dict(layer_windows=_layer_windows(kinds, window, num_layers))
    return {}


def _layer_windows(kinds: list[str], window: int | None, num_layers: int) -> tuple[int, ...]:
    """Each layer's window from transformers' `layer_types` (empty when none slides)."""
    if len(kinds) != num_layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of {num_layers} layers")
    if window is not None and window < 1:
        raise ValueError(f"sliding_window {window} must be at least 1")
    windows = tuple(window if kind == "sliding_attention" and window else 0 for kind in kinds)
    return windows if any(windows) else ()


def _gemma_fields(arch: str, raw: dict) -> dict:
    if arch not in GEMMAS:
        return {}
    fields = dict(embedding_multiplier=raw["hidden_size"] ** 0.5, embedding_multiplier_in_dtype=True,
                  norm_weight_offset=1.0)
    if arch != "GemmaForCausalLM":
        fields.update(_windowed_gemma_fields(raw, pattern=6 if arch == "Gemma3ForCausalLM" else 2))
    if arch == "VaultGemmaForCausalLM":  # (Gemma 2's layer without its two output norms)
        fields["sandwich_norms"] = False
    return fields


def _ropes_by_layer_type(raw: dict) -> tuple[dict, float]:
    """Two rotary setups: the global layers' as every family's (Gemma 3's: rope_theta,
    default 1e6, with rope_scaling; OLMo 3's: its YaRN), the windowed layers' base apart
    (default rope; Gemma 3's rope_local_base_freq, default 1e4). transformers 5 writes
    both in rope_parameters, by layer type."""
    by_type = raw.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        full = dict(by_type.get("full_attention") or {})
        local = dict(by_type.get("sliding_attention") or {})
    else:
        full = dict(raw.get("rope_scaling") or {})
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_type {local.get('rope_type')!r} for Gemma 3's sliding layers: default")
    raw = {**raw, "rope_parameters": full}
    raw.pop("rope_scaling", None)
    return raw, float(local.get("rope_theta", 10000.0))


def _windowed_gemma_fields(raw: dict, pattern: int) -> dict:
    """Which layers slide (`layer_types`, or transformers' default from the pattern: all but
    every `pattern`-th layer - Gemma 2 every other, Gemma 3 five in six), the caps, and the
    attention scale from query_pre_attn_scalar rather than head_dim."""
    num_layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
    pattern = raw.get("sliding_window_pattern", pattern)
    kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)]
    windows = _layer_windows(kinds, window, num_layers)
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = raw.get(name)
        if cap is not None and cap <= 0:
            raise ValueError(f"{name} {cap} must be positive (or null: no cap)")
        caps[name] = None if cap is None else float(cap)
    scalar = raw.get("query_pre_attn_scalar") or raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return dict(layer_windows=windows, sandwich_norms=True,
                attention_scale=float(scalar) ** -0.5, **caps)


def _granite_fields(arch: str, raw: dict) -> dict:
    if arch not in ("GraniteForCausalLM", "GraniteMoeForCausalLM", GRANITE_HYBRID):
        return {}
    fields = dict(embedding_multiplier=raw.get("embedding_multiplier", 1.0),
                  residual_multiplier=raw.get("residual_multiplier", 1.0),
                  attention_scale=raw.get("attention_multiplier", 1.0),  # transformers' default too
                  logits_scaling=raw.get("logits_scaling", 1.0))
    if fields["logits_scaling"] == 0:
        raise ValueError("logits_scaling must not be 0")
    return {name: float(value) for name, value in fields.items()}


def _check_top_k(top_k: int, num_experts: int, key: str) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{key} {top_k} must be within 1..{num_experts} experts")


def _check_silu_experts(raw: dict) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} with experts: only silu")


def _moe_fields(arch: str, raw: dict) -> dict:
    """Mixtral: every layer sparse, experts of intermediate_size, top-k renormalized.
    Qwen3-MoE: layers sparse every decoder_sparse_step but mlp_only_layers, experts of
    moe_intermediate_size, renormalized if norm_topk_prob."""
    if arch in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        # Qwen2-MoE's sparse layers, a shared expert gated beside them; Qwen3.5-MoE's in
        # every layer, its router always renormalizing (transformers' Qwen3_5MoeTopKRouter)
        if arch == "Qwen3_5MoeForCausalLM":
            raw = {**raw, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
        return _moe_fields("Qwen2MoeForCausalLM", raw)
    if arch == "GptOssForCausalLM":
        num_experts, top_k = raw["num_local_experts"], raw["num_experts_per_tok"]
        _check_top_k(top_k, num_experts, "num_experts_per_tok")
        # (its hidden_act names no activation of its experts': theirs is their own)
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                    norm_topk_prob=True, moe_topk_softmax=True, moe_layers=tuple(range(raw["num_hidden_layers"])),
                    moe_bias=True, swiglu_alpha=float(raw["swiglu_alpha"]), swiglu_limit=float(raw["swiglu_limit"]))
    if arch in DEEPSEEK_V3_MOES:  # (GLM-4.7-Flash's config may leave its one MTP layer uncounted)
        return _deepseek_v3_moe_fields(raw, mtp_layers=1 if arch == "Glm4MoeLiteForCausalLM" else 0)
    if arch == "DeepseekV2ForCausalLM":
        return _deepseek_v2_moe_fields(raw)
    if arch == GRANITE_HYBRID:  # GraniteMoe's experts (where it has any) beside its shared MLP, unweighed
        if not raw.get("num_local_experts"):
            return {}
        return dict(_moe_fields("GraniteMoeForCausalLM", raw), shared_expert_intermediate_size=raw["shared_intermediate_size"],
                    shared_expert_gated=False)
    if arch == "Lfm2MoeForCausalLM":
        # After num_dense_layers dense MLPs, experts chosen by sigmoid score plus the block's
        # expert_bias (where use_expert_bias), weighed by their scores, renormalized (their
        # sum + 1e-6) where norm_topk_prob says, times routed_scaling_factor; no shared expert
        num_experts, top_k = raw["num_experts"], raw["num_experts_per_tok"]
        _check_top_k(top_k, num_experts, "num_experts_per_tok")
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                    norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                    moe_layers=tuple(range(raw.get("num_dense_layers") or 0, raw["num_hidden_layers"])),
                    moe_score_correction="sigmoid", moe_correction_bias=bool(raw.get("use_expert_bias", True)),
                    routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0), moe_norm_eps=1e-6)
    if arch == "AfmoeForCausalLM":
        _check_silu_experts(raw)
        num_experts, top_k = raw["num_experts"], raw["num_experts_per_tok"]
        _check_top_k(top_k, num_experts, "num_experts_per_tok")
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                    norm_topk_prob=True, moe_layers=tuple(range(raw.get("num_dense_layers") or 0, raw["num_hidden_layers"])),
                    shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("num_shared_experts") or 0),
                    shared_expert_gated=False, moe_score_correction="sigmoid",
                    routed_scaling_factor=float(raw.get("route_scale") or 1.0))
    if arch == "ExaoneMoeForCausalLM":  # (DeepSeek-V3's experts under names of its own; its MTP is mtp.*, no layer)
        raw = {**raw, "n_routed_experts": raw["num_experts"], "n_shared_experts": raw.get("num_shared_experts")}
        return dict(_deepseek_v3_moe_fields(raw), skipped_layers=0)
    if arch == "Mistral4ForCausalLM":  # (DeepSeek-V3's experts chosen by softmax score alone: no correction bias)
        return dict(_deepseek_v3_moe_fields(raw), moe_score_correction="softmax", moe_correction_bias=False)
    if arch == "HunYuanMoEV1ForCausalLM":
        return _hunyuan_moe_fields(raw)
    if arch == "Ernie4_5_MoeForCausalLM":
        return _ernie_moe_fields(raw)
    if arch == "MiniMaxM2ForCausalLM":  # (its scores renormalized always: transformers' router has no switch)
        return dict(_moe_fields("MixtralForCausalLM", raw), moe_score_correction="sigmoid")
    if arch in ("OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        if raw.get("clip_qkv") is not None:
            raise ValueError(f"unsupported clip_qkv {raw['clip_qkv']} for {arch}: unclipped queries, keys and values only")
        raw = {**raw, "moe_intermediate_size": raw["intermediate_size"]}  # (its experts are of the dense size)
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM",
                    "OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        return {}
    _check_silu_experts(raw)
    num_experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    top_k = raw.get("num_experts_per_tok", 0)
    _check_top_k(top_k, num_experts, "num_experts_per_tok")
    layers = range(raw["num_hidden_layers"])
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                    norm_topk_prob=True, moe_layers=tuple(layers), moe_topk_softmax=arch == "GraniteMoeForCausalLM")
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
    if step < 1:
        raise ValueError(f"decoder_sparse_step {step} must be at least 1")
    shared = (raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                moe_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
                shared_expert_intermediate_size=shared)


def _deepseek_v3_moe_fields(raw: dict, mtp_layers: int = 0) -> dict:
    """DeepSeek-V3's experts (transformers' DeepseekV3MoE), GLM-4.5's and dots.llm1's: dense
    layers before first_k_dense_replace (or as mlp_layer_types says, GLM-4.7-Flash's), then
    sparse ones of n_routed_experts, DeepSeek-V3's router, and n_shared_experts ungated
    shared experts (one MLP of their summed size); the multi-token-prediction layers past
    the last skipped, num_nextn_predict_layers of them (`mtp_layers` where the config leaves
    the count out: GLM-4.7-Flash's, whose one transformers skips by name)."""
    _check_silu_experts(raw)
    num_experts, top_k = raw["n_routed_experts"], raw["num_experts_per_tok"]
    groups, top_groups = raw.get("n_group") or 1, raw.get("topk_group") or 1
    _check_top_k(top_k, num_experts, "num_experts_per_tok")
    if num_experts % groups or num_experts // groups < 2 or not 0 < top_groups <= groups:
        raise ValueError(f"n_group {groups} and topk_group {top_groups} must split {num_experts} experts into groups "
                         "of at least 2 and keep some")
    if top_k > top_groups * (num_experts // groups):
        raise ValueError(f"num_experts_per_tok {top_k} is more than the {top_groups} kept groups hold")
    kinds = raw.get("mlp_layer_types")  # (GLM-4.7-Flash's: "dense" or "sparse" a layer)
    if kinds is not None and (len(kinds) != raw["num_hidden_layers"] or set(kinds) - {"dense", "sparse"}):
        raise ValueError(f"unsupported mlp_layer_types {kinds!r}: 'dense' or 'sparse' for each of the "
                         f"{raw['num_hidden_layers']} layers")
    sparse = [i for i, kind in enumerate(kinds) if kind == "sparse"] if kinds is not None \
        else range(raw.get("first_k_dense_replace") or 0, raw["num_hidden_layers"])  # (Solar Open's: none dense)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw["norm_topk_prob"]),  # (transformers' default filled in: GLM's on, dots' off)
                moe_layers=tuple(sparse),
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
                shared_expert_gated=False, moe_score_correction="sigmoid", moe_num_groups=groups, moe_topk_groups=top_groups,
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                skipped_layers=raw.get("num_nextn_predict_layers", mtp_layers) or 0)


def _deepseek_v2_moe_fields(raw: dict) -> dict:
    """DeepSeek-V2's experts (transformers' DeepseekV2Moe): dense layers before
    first_k_dense_replace, then sparse ones: the top k of n_routed_experts by softmax score
    (topk_method "greedy"), or among the best topk_group of n_group groups, a group ranked by
    its best score ("group_limited_greedy"), weighed by their scores times
    routed_scaling_factor, never renormalized (transformers' router has no switch for it: a
    config asking for it is refused, where vLLM's would renormalize), beside n_shared_experts
    ungated shared experts."""
    _check_silu_experts(raw)
    if raw.get("norm_topk_prob"):
        raise ValueError("unsupported norm_topk_prob true for DeepSeek-V2: its router's weights unnormalized only")
    if raw.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias true for DeepSeek-V2: unbiased MLPs only")
    method = raw.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported topk_method {method!r} for DeepSeek-V2: greedy or group_limited_greedy")
    grouped = method == "group_limited_greedy"
    num_experts, top_k = raw["n_routed_experts"], raw["num_experts_per_tok"]
    groups, top_groups = (raw.get("n_group") or 1, raw.get("topk_group") or 1) if grouped else (1, 1)
    _check_top_k(top_k, num_experts, "num_experts_per_tok")
    if grouped and (num_experts % groups or not 0 < top_groups <= groups or top_k > top_groups * (num_experts // groups)):
        raise ValueError(f"n_group {groups} and topk_group {top_groups} must split {num_experts} experts into groups "
                         f"whose kept ones hold num_experts_per_tok {top_k}")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                moe_layers=tuple(range(raw["first_k_dense_replace"], raw["num_hidden_layers"])),
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
                shared_expert_gated=False, moe_score_correction="softmax", moe_correction_bias=False,
                moe_group_by_max=True, moe_num_groups=groups, moe_topk_groups=top_groups,
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))


def _hunyuan_moe_fields(raw: dict) -> dict:
    """Hunyuan MoE (transformers' HunYuanMoEV1Moe): every layer sparse, experts and the shared
    MLP of intermediate_size; `num_experts` and `moe_topk` may be given a layer each (the
    checkpoints repeat one value: anything else is refused)."""
    def one(key: str) -> int:
        value = raw[key]
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"unsupported {key} {value}: one value for every layer only")
            value = value[0]
        return int(value)

    num_experts, top_k = one("num_experts"), one("moe_topk")
    _check_top_k(top_k, num_experts, "moe_topk")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                norm_topk_prob=True, moe_layers=tuple(range(raw["num_hidden_layers"])),
                shared_expert_intermediate_size=raw["intermediate_size"], shared_expert_gated=False,
                moe_router_float32=True)


def _ernie_moe_fields(raw: dict) -> dict:
    """ERNIE 4.5 MoE (transformers' Ernie4_5_MoeSparseMoeBlock): sparse layers every
    moe_layer_interval from moe_layer_start_index to moe_layer_end_index, experts of
    moe_intermediate_size chosen by softmax probability + a correction bias, weighed by the
    probabilities renormalized (their sum floored at moe_norm_min), and
    moe_num_shared_experts ungated shared experts (one MLP of their summed size)."""
    if raw.get("use_bias"):
        raise ValueError("unsupported use_bias true for ERNIE 4.5 MoE: unbiased projections only")
    _check_silu_experts(raw)
    num_experts, top_k = raw["moe_num_experts"], raw["moe_k"]
    _check_top_k(top_k, num_experts, "moe_k")
    interval, start, end = raw["moe_layer_interval"], raw["moe_layer_start_index"], raw["moe_layer_end_index"]
    if interval < 1:
        raise ValueError(f"moe_layer_interval {interval} must be at least 1")
    layers = tuple(i for i in range(raw["num_hidden_layers"]) if (i + 1) % interval == 0 and start <= i <= end)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=True, moe_layers=layers,
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("moe_num_shared_experts") or 0),
                shared_expert_gated=False, moe_score_correction="softmax", moe_norm_min=float(raw["moe_norm_min"]),
                moe_router_float32=True)
