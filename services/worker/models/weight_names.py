"""How checkpoint names map onto the decoder's modules: fused q/k/v and gate/up, a
multimodal checkpoint's language model, families' own names, stacked experts, and what is
left unread."""

from __future__ import annotations

from services.worker.models.families.registry import (
    DEEPSEEK_V3_MOES,
    GRANITE_HYBRID,
    HUNYUANS,
    LINEAR_ATTENTION,
    OLMO_HYBRID,
    SHORT_CONVS,
)

# checkpoint name part -> (our fused module, shard index)
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# A multimodal checkpoint's language model (Gemma 3's), as the Hub's checkpoints and
# transformers 5's in-memory layout name it, and the parts the loader leaves unread.
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model."}


MULTIMODAL_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                    "visual.", "model.visual.")  # (the last two Qwen-VL's)


# Mixtral's (and GraniteMoe's router's) names for the parts that Qwen3-MoE and our modules call otherwise.
ALIASES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj.",
           ".mlp.router.layer.": ".mlp.gate."}


# GLM-4-0414's names for Gemma 2's four norms: its post_attention_layernorm is the MLP's
# input norm, the attention's output norm is post_self_attn_layernorm.
GLM4_NORMS = {".post_attention_layernorm.": ".pre_feedforward_layernorm.",
              ".post_self_attn_layernorm.": ".post_attention_layernorm.",
              ".post_mlp_layernorm.": ".post_feedforward_layernorm."}
# Each family's own names for our modules, by architecture: a weight's name takes the first
# that it holds, once (GLM-4-0414's overlap: one of its names is another's rename).
NAMES_OF = {
    "Glm4ForCausalLM": GLM4_NORMS,
    "ApertusForCausalLM": {".attention_layernorm.": ".input_layernorm.",
                           ".feedforward_layernorm.": ".post_attention_layernorm."},
    **dict.fromkeys(HUNYUANS, {".query_layernorm.": ".q_norm.", ".key_layernorm.": ".k_norm.",
                               ".mlp.gate.wg.": ".mlp.gate.", ".mlp.shared_mlp.": ".mlp.shared_expert."}),
    **dict.fromkeys((*DEEPSEEK_V3_MOES, "DeepseekV2ForCausalLM", "Mistral4ForCausalLM"),
                    {".mlp.shared_experts.": ".mlp.shared_expert."}),
    "Ernie4_5_MoeForCausalLM": {".mlp.shared_experts.": ".mlp.shared_expert.", ".mlp.moe_statics.": ".mlp.gate."},
    # (its bias beside the router, in the block Mixtral's names call block_sparse_moe)
    "MiniMaxM2ForCausalLM": {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"},
    "VaultGemmaForCausalLM": {".pre_feedforward_layernorm.": ".post_attention_layernorm."},
    "AfmoeForCausalLM": {".pre_mlp_layernorm.": ".pre_feedforward_layernorm.",
                         ".post_mlp_layernorm.": ".post_feedforward_layernorm.", ".mlp.router.gate.": ".mlp.gate.",
                         ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
                         ".mlp.shared_experts.": ".mlp.shared_expert.", ".self_attn.gate_proj.": ".self_attn.output_gate."},
    "ExaoneMoeForCausalLM": {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
                             ".mlp.shared_experts.": ".mlp.shared_expert."},
    # (a hybrid's token mixer is `self_attn` whatever it is; its gated norm weighs by w alone)
    **dict.fromkeys(LINEAR_ATTENTION, {".linear_attn.norm.weight": ".self_attn.norm_weight",
                                       ".linear_attn.": ".self_attn."}),
    # (its final norm is called embedding_norm; its short convolutions are `self_attn` here)
    # (its MLPs' w1/w3/w2 read as Mixtral's experts' are, ALIASES)
    **dict.fromkeys(SHORT_CONVS, {
        "model.embedding_norm.": "model.norm.", ".operator_norm.": ".input_layernorm.",
        ".ffn_norm.": ".post_attention_layernorm.", ".feed_forward.expert_bias": ".mlp.gate.e_score_correction_bias",
        ".feed_forward.": ".mlp.", ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".self_attn.q_layernorm.": ".self_attn.q_norm.", ".self_attn.k_layernorm.": ".self_attn.k_norm.",
        ".conv.": ".self_attn."}),
    # (its q/k/v products and their convolutions fused by olmo_hybrid_tensors; its norms'
    # names those transformers renames)
    OLMO_HYBRID: {".attention_layer_norm.": ".input_layernorm.", ".feedforward_layer_norm.": ".post_attention_layernorm.",
                  ".linear_attn.o_norm.weight": ".self_attn.norm_weight", ".linear_attn.g_proj.": ".self_attn.in_proj_z.",
                  ".linear_attn.a_proj.": ".self_attn.in_proj_a.", ".linear_attn.b_proj.": ".self_attn.in_proj_b.",
                  ".linear_attn.o_proj.": ".self_attn.out_proj.", ".linear_attn.": ".self_attn."},
    # (its attention's names Qwen3's, but its gate's: a head a gate, AFMoE's name)
    "Lfm3ForCausalLM": {".self_attn.gate_proj.": ".self_attn.output_gate.",
        "model.embedding_norm.": "model.norm.", ".operator_norm.": ".input_layernorm.",
        ".post_operator_norm.": ".post_attention_layernorm.", ".ffn_norm.": ".pre_feedforward_layernorm.",
        ".post_ffn_norm.": ".post_feedforward_layernorm.", ".feed_forward.": ".mlp.", ".conv.": ".self_attn."},
    # (Granite 4.0-H's shared MLP: granite_hybrid_tensors)
    GRANITE_HYBRID: {".mamba.norm.weight": ".self_attn.norm_weight", ".mamba.": ".self_attn."},
    "BambaForCausalLM": {".mamba.norm.weight": ".self_attn.norm_weight", ".mamba.": ".self_attn.",
                         ".feed_forward.": ".mlp.", ".pre_ff_layernorm.": ".post_attention_layernorm.",
                         "model.final_layernorm.": "model.norm."},
}


# Experts stacked in one tensor each: one expert's row each. GraniteMoe's are [experts, out,
# in]; Qwen3-VL-MoE's [experts, in, out] as the Hub ships them, [experts, out, in] as
# transformers 5 saves them: read by shape, and where the shape cannot tell (in == out) as
# the Hub's.
STACKED_EXPERTS = {".mlp.input_linear.weight": "gate_up_proj", ".mlp.output_linear.weight": "down_proj",
                   ".mlp.experts.gate_up_proj": "gate_up_proj", ".mlp.experts.down_proj": "down_proj"}


TRANSPOSED_FIRST = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


# Families whose checkpoints stack their experts in their transformers class's own layout,
# [experts, out, in], whatever the shapes (transformers converts none on load: Mistral 4's)
STACKED_OUT_IN = ("Mistral4ForCausalLM",)


# Checkpoint tensors a family holds beside its model that transformers leaves unread
# (EXAONE MoE's multi-token-prediction module)
UNREAD_PREFIXES = {"ExaoneMoeForCausalLM": ("mtp.",), **dict.fromkeys(LINEAR_ATTENTION, ("mtp.",))}
