"""Every architecture llmbus serves, and the groups of them the config reader and the
decoder ask about (each group a trait several families share: one decoder builds them all,
models/decoder.py, held to transformers by tests/test_model_families.py). A family's
own config reading lives beside this file (moe.py, hybrid.py, layer_normed.py, ...)."""

from __future__ import annotations

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
