"""DeepSeek-V3's and V2's model (multi-head latent attention, grouped routers with shared experts)
and the families that borrow from it: Mistral 4, Youtu-LLM, dots.llm1, Solar Open."""

from __future__ import annotations

from services.worker.models.families.family import Family

SOLAR_OPEN = Family(
    name="Solar Open",
    architectures=("SolarOpenForCausalLM",),
    served="`SolarOpenForCausalLM` (Solar-Open-100B)",
    adds=("a Llama's attention (q/k/v biased where `attention_bias` says, o_proj never) with GLM-4.5's experts "
          "(DeepSeek-V3's router, shared experts) in every layer"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("solar_open",),
    traits=("deepseek_v3_experts", "unclassified", "o_proj_unbiased"),
    config_class="solar_open",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert."},
)


DEEPSEEK_V3 = Family(
    name="DeepSeek-V3",
    architectures=("DeepseekV3ForCausalLM",),
    served=("`DeepseekV3ForCausalLM` (DeepSeek-V3, R1, V3.1; Kimi K2's and Moonlight's weights too, though their "
            "tiktoken tokenizers are their own code, which llmbus does not run: a `tokenizer.json` beside them "
            "serves)"),
    adds=("multi-head latent attention (services/worker/layers/latent_attention.py): keys and values from one "
          "`kv_lora_rank` latent a token (normed) and a `qk_rope_head_dim` key shared by every head, queries "
          "through a `q_lora_rank` latent or one `q_proj` (`q_lora_rank` null, as DeepSeek-V2-Lite's); the cache "
          "holds the latent alone, one head of `kv_lora_rank + qk_rope_head_dim` (576: ~71x less than the expanded"
          " heads at V3's shape), its K and V halves one memory (the latent is both), attention run on it with "
          "`kv_b_proj`'s key half absorbed into the queries and its value half applied after the weighed sum "
          "(vLLM's decode form, for prefill too); the interleaved rotating rows reordered at load "
          "(`rope_interleave`, its default; by halves where false); the softmax scaled by YaRN's `mscale_all_dim` "
          "squared; GLM-4.5's experts (DeepSeek-V3's router) after `first_k_dense_replace` dense layers; the "
          "multi-token-prediction layers skipped (the first is a drafter under `--speculative-config '{\"method\": "
          "\"mtp\"}'`); its FP8 checkpoints (V3's and R1's as released: "
          "`weight_scale_inv` block scales) widened at load (models/checkpoints/fp8_weights.py); LoRA adapters "
          "refused (`--enable-lora`, by name)"),
    cpu=("all dtypes and int8/int4 (`kv_b_proj` kept unquantized: its halves are read per head) on the module path"
         " (the one-call decode layer steps aside)"),
    gpu="the Triton attention over the latent head (one KV head, 576 wide), experts as Mixtral's",
    tests=("deepseek_v3",),
    traits=("deepseek_v3_experts", "latent_attention", "unclassified"),
    config_class="deepseek_v3",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert."},
)


MISTRAL_4 = Family(
    name="Mistral 4",
    architectures=("Mistral4ForCausalLM",),
    served="`Mistral4ForCausalLM` (and as a `Mistral3ForConditionalGeneration`'s text model)",
    adds=("DeepSeek-V3's latent attention with Ministral 3's temperature on the queries; after "
          "`first_k_dense_replace` dense layers, experts by softmax score alone (no correction bias) within the "
          "best `topk_group` of `n_group` groups (a group by its two best), renormalized where `norm_topk_prob` "
          "says, times `routed_scaling_factor`, beside shared experts; its experts stacked in the checkpoint in "
          "its transformers class's own [experts, out, in] layout (read so whatever the shapes)"),
    cpu="as DeepSeek-V3",
    gpu="as DeepSeek-V3",
    tests=("mistral4",),
    traits=("latent_attention", "queries_scaled_by_position", "unclassified"),
    config_class="mistral4",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert."},
    stacked_experts_out_in=True,
)


YOUTU_LLM = Family(
    name="Youtu-LLM",
    architectures=("YoutuForCausalLM",),
    served="`YoutuForCausalLM` (Youtu-LLM-2B)",
    adds="DeepSeek-V3's latent attention in a dense Llama (its gated MLP in every layer), tied embeddings by default",
    cpu="as DeepSeek-V3",
    gpu="as DeepSeek-V3",
    tests=("youtu",),
    traits=("latent_attention", "unclassified"),
    config_class="youtu",
)


DEEPSEEK_V2 = Family(
    name="DeepSeek-V2",
    architectures=("DeepseekV2ForCausalLM",),
    served="`DeepseekV2ForCausalLM` (DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2)",
    adds=("DeepSeek-V3's latent attention (rotating by interleaved pairs always: transformers' complex-number "
          "rotary); after `first_k_dense_replace` dense layers, experts by softmax score alone (no correction "
          "bias), the top `num_experts_per_tok` of all (`topk_method` greedy) or within the best `topk_group` of "
          "`n_group` groups, a group ranked by its best expert (`group_limited_greedy`), weighed by their scores "
          "times `routed_scaling_factor`, never renormalized (as transformers' router; a config with "
          "`norm_topk_prob` true is refused by name, where vLLM would renormalize), beside `n_shared_experts` "
          "shared experts added unweighed"),
    cpu="as DeepSeek-V3",
    gpu="as DeepSeek-V3",
    tests=("deepseek_v2",),
    traits=("latent_attention", "unclassified"),
    config_class="deepseek_v2",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert."},
)


DOTS_LLM1 = Family(
    name="dots.llm1",
    architectures=("Dots1ForCausalLM",),
    served="`Dots1ForCausalLM` (dots.llm1.base, dots.llm1.inst)",
    adds=("Qwen3's attention (per-head query/key norms; a window on the layers `layer_types` names, from "
          "`max_window_layers` on) with GLM-4.5's experts: dense layers before `first_k_dense_replace`, then "
          "DeepSeek-V3's router (unnormalized by default: `norm_topk_prob` false) and ungated shared experts"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("dots1",),
    traits=("deepseek_v3_experts", "unclassified", "always_windowed_by_layer_type", "windowed", "qk_norm"),
    config_class="dots1",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert."},
)


FAMILIES = (SOLAR_OPEN, DEEPSEEK_V3, MISTRAL_4, YOUTU_LLM, DEEPSEEK_V2, DOTS_LLM1)
