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
from services.worker.models.families.traits import TRAITS

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


def with_trait(trait: str) -> tuple[str, ...]:
    """The architectures whose family names the trait (traits.py)."""
    if trait not in TRAITS:
        raise KeyError(trait)
    return tuple(arch for arch, family in FAMILY_OF.items() if trait in family.traits)


COHERES = with_trait("cohere")
LINEAR_ATTENTION = with_trait("linear_attention")
OLMO_HYBRID = "OlmoHybridForCausalLM"  # (its Gated DeltaNet read apart: layers/gated_delta_net.py)
SHORT_CONVS = with_trait("short_conv")
GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"
MAMBAS = with_trait("mamba")
DEEPSEEK_V3_MOES = with_trait("deepseek_v3_experts")
LATENT_ATTENTION = with_trait("latent_attention")
QUERIES_SCALED_BY_POSITION = with_trait("queries_scaled_by_position")
HUNYUANS = with_trait("hunyuan")
EXAONES = with_trait("exaone")
LAYER_NORMED = with_trait("layer_normed")
UNCLASSIFIED = with_trait("unclassified")
GLMS = with_trait("glm")
OLMOS = with_trait("olmo")
QK_NORMED = with_trait("qk_norm")
QK_NORMS_OVER_HEADS = with_trait("qk_norm_over_heads")
POST_NORMED = with_trait("post_normed")
SANDWICH_NORMED = with_trait("sandwich_norms")
O_PROJ_UNBIASED = with_trait("o_proj_unbiased")
ATTENTION_GATED = with_trait("attention_gate")
ROTARY_INTERLEAVED = with_trait("rotary_interleaved")
ROPES_BY_LAYER_TYPE = with_trait("ropes_by_layer_type")
GEMMAS = with_trait("gemma")
EVERY_LAYER_WINDOWED = with_trait("every_layer_windowed")
QWENS = with_trait("qwen")
BY_LAYER_TYPE = with_trait("windowed_by_layer_type")
ALWAYS_BY_LAYER_TYPE = with_trait("always_windowed_by_layer_type")
WINDOWED = with_trait("windowed")


# Learned absolute positions in place of rotary: the offset of a position's row in the table
LEARNED_POSITIONS = {arch: f.learned_positions_offset for arch, f in FAMILY_OF.items()
                     if f.learned_positions_offset is not None}


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
