"""GLM's families (Zhipu): GLM-4 and GLM-4-0414 (half of each head rotating by interleaved pairs),
GLM-4.5 (DeepSeek-V3's experts) and GLM-4.7-Flash (DeepSeek-V3's model)."""

from __future__ import annotations

from services.worker.models.families.family import Family

GLM_4 = Family(
    name="GLM-4",
    architectures=("GlmForCausalLM",),
    served="`GlmForCausalLM` (glm-4-9b-chat-hf)",
    adds=("half of each head rotating (`partial_rotary_factor` 0.5) by interleaved pairs: the loader reorders each"
          " query and key head's rows (weights, biases, LoRA adapters' B) to the rotate-half layout every kernel "
          "here computes, which leaves q·k, and so the model, as it is; q/k/v biases without an o_proj bias; "
          "gate/up fused in the checkpoint (Phi-3's layout); config defaults from transformers' classes"),
    cpu=("all dtypes and int8/int4; the one-call decode layer included (the reordered rows rotate as any "
         "half-rotary head's; GLM-4-0414's norms as Gemma 2's)"),
    gpu="as Llama",
    tests=("glm",),
    traits=("glm", "o_proj_unbiased", "rotary_interleaved"),
    config_class="glm",
)


GLM_4_0414 = Family(
    name="GLM-4-0414",
    architectures=("Glm4ForCausalLM",),
    served="`Glm4ForCausalLM` (GLM-4-0414, GLM-Z1)",
    adds=("GLM-4's layer with Gemma 2's four norms under names of their own: `post_self_attn_layernorm` the "
          "attention's output norm, `post_attention_layernorm` the MLP's input norm"),
    cpu="as GLM-4 (its norms as Gemma 2's in the one-call decode layer)",
    gpu="as Llama",
    tests=("glm4",),
    traits=("glm", "o_proj_unbiased", "sandwich_norms", "rotary_interleaved"),
    config_class="glm4",
    weight_names={".post_attention_layernorm.": ".pre_feedforward_layernorm.",
                  ".post_self_attn_layernorm.": ".post_attention_layernorm.",
                  ".post_mlp_layernorm.": ".post_feedforward_layernorm."},
)


GLM_4_5 = Family(
    name="GLM-4.5",
    architectures=("Glm4MoeForCausalLM",),
    fields=lambda raw: {"qk_norm": bool(raw.get("use_qk_norm"))},
    served="`Glm4MoeForCausalLM` (GLM-4.5, GLM-4.5-Air, GLM-4.6)",
    adds=("GLM's q/k/v biases (o_proj none) with half of each head rotating, by halves (NeoX's, not GLM-4's "
          "interleaved pairs); per-head query/key norms where `use_qk_norm` says; dense layers before "
          "`first_k_dense_replace`, then sparse ones: DeepSeek-V3's router in float32 (sigmoid scores; the choice "
          "by score plus the learned `e_score_correction_bias`, kept in float32, among the best `topk_group` of "
          "`n_group` groups, a group ranked by its two best; the chosen experts weighed by their plain scores, "
          "renormalized, times `routed_scaling_factor`) and `n_shared_experts` shared experts added unweighed; the"
          " checkpoint's multi-token-prediction layers (`num_nextn_predict_layers`, past the last layer) skipped "
          "at load, as transformers skips them, or the first read as a drafter under `--speculative-config "
          "'{\"method\": \"mtp\"}'`"),
    cpu="as Mixtral",
    gpu="as Mixtral (the router's ops on the device: CUDA graphs take it)",
    tests=("glm4_moe",),
    traits=("deepseek_v3_experts", "unclassified", "o_proj_unbiased"),
    config_class="glm4_moe",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert."},
)


GLM_4_7_FLASH = Family(
    name="GLM-4.7-Flash",
    architectures=("Glm4MoeLiteForCausalLM",),
    served="`Glm4MoeLiteForCausalLM` (GLM-4.7-Flash)",
    adds=("DeepSeek-V3's model (latent attention, its router and shared experts), its dense and sparse layers by "
          "`mlp_layer_types`; its multi-token-prediction layer skipped (its config may not count it: one is "
          "skipped, as transformers skips it by name; a drafter under `--speculative-config '{\"method\": \"mtp\"}'`)"),
    cpu="as DeepSeek-V3",
    gpu="as DeepSeek-V3",
    tests=("glm4_moe_lite",),
    traits=("deepseek_v3_experts", "latent_attention", "unclassified"),
    config_class="glm4_moe_lite",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert."},
)


FAMILIES = (GLM_4, GLM_4_0414, GLM_4_5, GLM_4_7_FLASH)
