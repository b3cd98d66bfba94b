"""Every family llmbus serves (a record a family, in this folder's files by lineage) and the
groups of architectures the config reader and the decoder ask about, each a trait several
families share: one decoder builds them all (models/decoder.py), held to transformers by
tests/test_model_families.py. Adding a family: its record in a lineage's file (or a new
file named here), its tiny model in tests/tiny_models.py, its row in the tests."""

from __future__ import annotations

from services.worker.models.families import (
    arcee,
    deepseek,
    ernie,
    exaone,
    gemma,
    glm,
    gpt_oss,
    granite,
    hunyuan,
    layer_normed,
    lfm,
    llama,
    minimax,
    nemotron,
    olmo,
    qwen,
)
from services.worker.models.families.family import Family

FAMILIES: tuple[Family, ...] = (*llama.FAMILIES, *qwen.FAMILIES, *gemma.FAMILIES, *olmo.FAMILIES, *glm.FAMILIES,
                                *exaone.FAMILIES, *ernie.FAMILIES, *hunyuan.FAMILIES, *arcee.FAMILIES,
                                *layer_normed.FAMILIES, *granite.FAMILIES, *deepseek.FAMILIES, *minimax.FAMILIES,
                                *gpt_oss.FAMILIES, *lfm.FAMILIES, *nemotron.FAMILIES)


FAMILY_OF: dict[str, Family] = {arch: family for family in FAMILIES for arch in family.architectures}


SUPPORTED_ARCHITECTURES = tuple(FAMILY_OF)


# Families whose config.json may leave out what their transformers config class defaults
# differently from a Llama's (SmolLM3: tied embeddings, a rotary base of 2e6, NoPE every
# fourth layer): read through that class, as transformers reads them.
FILLED_BY_TRANSFORMERS = {arch: f.config_class for arch, f in FAMILY_OF.items() if f.config_class}


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


UNGATED = {arch: f.ungated_acts for arch, f in FAMILY_OF.items() if f.ungated_acts}


HIDDEN_ACTS = tuple(dict.fromkeys((*GATED_ACTS, *(a for acts in UNGATED.values() for a in acts))))
