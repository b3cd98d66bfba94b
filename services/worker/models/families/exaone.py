"""LG's EXAONE 4.0 (output norms with per-head query/key norms, NoPE global layers) and EXAONE MoE."""

from __future__ import annotations

from services.worker.models.families.family import Family

EXAONE_4_0 = Family(
    name="EXAONE 4.0",
    architectures=("Exaone4ForCausalLM",),
    served=("`Exaone4ForCausalLM` (EXAONE-4.0-1.2B, 32B), and the language model of "
            "`Exaone4_5_ForConditionalGeneration` (EXAONE 4.5: its `text_config`, `model.language_model.*`, the "
            "vision tower unread)"),
    adds=("OLMo 2's output norms (none before attention and the MLP) with Qwen3's per-head query/key norms; with a"
          " `sliding_window`, windowed layers where `layer_types` says (three in four by default) and the global "
          "layers attending without rotary positions (NoPE, as transformers skips them); config defaults from "
          "transformers' class"),
    cpu="all dtypes and int8/int4; the one-call decode layer included",
    gpu="as Llama",
    tests=("exaone4", "exaone4_5"),
    traits=("exaone", "post_normed", "always_windowed_by_layer_type", "windowed", "qk_norm", "sandwich_norms"),
    config_class="exaone4",
)


EXAONE_MOE = Family(
    name="EXAONE MoE",
    architectures=("ExaoneMoeForCausalLM",),
    served="`ExaoneMoeForCausalLM` (K-EXAONE-236B-A23B)",
    adds=("EXAONE 4.0's attention (per-head query/key norms, windows by `layer_types`, the global layers without "
          "rotary) under the usual pre-norms (OLMoE's layer, not EXAONE 4.0's output norms), dense or sparse "
          "layers by `mlp_layer_types`, the sparse ones DeepSeek-V3's experts (`num_experts`, "
          "`num_shared_experts`, the correction bias beside the block); its multi-token-prediction module "
          "(`mtp.*`) left unread, as transformers leaves it"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("exaone_moe",),
    traits=("exaone", "unclassified", "always_windowed_by_layer_type", "windowed", "qk_norm"),
    config_class="exaone_moe",
    weight_names={".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
                  ".mlp.shared_experts.": ".mlp.shared_expert."},
    unread=("mtp.",),
)


FAMILIES = (EXAONE_4_0, EXAONE_MOE)
