"""How checkpoint names map onto the decoder's modules: fused q/k/v and gate/up, a
multimodal checkpoint's language model, families' own names, stacked experts, and what is
left unread (a family's own names are in its record: models/families/)."""

from __future__ import annotations

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


# Experts stacked in one tensor each: one expert's row each. GraniteMoe's are [experts, out,
# in]; Qwen3-VL-MoE's [experts, in, out] as the Hub ships them, [experts, out, in] as
# transformers 5 saves them: read by shape, and where the shape cannot tell (in == out) as
# the Hub's.
STACKED_EXPERTS = {".mlp.input_linear.weight": "gate_up_proj", ".mlp.output_linear.weight": "down_proj",
                   ".mlp.experts.gate_up_proj": "gate_up_proj", ".mlp.experts.down_proj": "down_proj"}


TRANSPOSED_FIRST = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
