"""OLMo's families (Ai2): norms on each branch's output, query/key norms over all heads; OLMo 3's
windows, OLMoE's and FlexOlmo's experts, OLMo Hybrid's DeltaNet layers."""

from __future__ import annotations

from services.worker.models.families.family import Family

OLMO_2 = Family(
    name="OLMo 2",
    architectures=("Olmo2ForCausalLM",),
    served="`Olmo2ForCausalLM`",
    adds=("a norm on the attention's and on the MLP's output (`post_attention_layernorm`, "
          "`post_feedforward_layernorm`) and none before either (the residual add alone where other families norm "
          "the branch's input: `layers/rms_norm.py`'s ResidualAdd); query and key norms over all of a token's "
          "heads at once (`q_norm` over num_heads × head_dim, `k_norm` over the KV heads'), before rotary; what "
          "config.json leaves out read with OLMo 2's defaults through transformers' config class. In bfloat16 its "
          "norms apply the weight after the cast (Llama's order; OLMo 2's is before): a last-bit difference"),
    cpu=("all dtypes and int8/int4; the one-call decode layer included (a norm's weight left out is its residual "
         "add alone; query/key norms one row per token)"),
    gpu="as Llama",
    tests=("olmo2",),
    traits=("olmo", "qk_norm_over_heads", "post_normed", "qk_norm", "sandwich_norms"),
    config_class="olmo2",
)


OLMO_3 = Family(
    name="OLMo 3",
    architectures=("Olmo3ForCausalLM",),
    served="`Olmo3ForCausalLM`",
    adds=("OLMo 2's layer; windowed layers where `layer_types` says (transformers' default: three in four), always"
          " (no `use_sliding_window` switch); rotary by layer type as Gemma 3's, the global layers' with the "
          "config's scaling (YaRN in the long-context checkpoints), the windowed layers' default"),
    cpu="as OLMo 2",
    gpu="as Llama",
    tests=("olmo3",),
    traits=("olmo", "qk_norm_over_heads", "post_normed", "ropes_by_layer_type", "always_windowed_by_layer_type",
           "windowed", "qk_norm", "sandwich_norms"),
    config_class="olmo3",
)


OLMOE = Family(
    name="OLMoE",
    architectures=("OlmoeForCausalLM",),
    served="`OlmoeForCausalLM` (OLMoE-1B-7B)",
    adds=("OLMo 2's query/key norms over all of a token's heads, with the usual norms before attention and the "
          "MLP; every layer sparse, 64 experts of `intermediate_size`, top 8, weighed by the softmax over all of "
          "them (`norm_topk_prob` false, as its config says) - Qwen3-MoE's sparse layer; `clip_qkv` refused by "
          "name"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("olmoe",),
    traits=("qk_norm_over_heads", "qk_norm"),
    config_class="olmoe",
)


FLEXOLMO = Family(
    name="FlexOlmo",
    architectures=("FlexOlmoForCausalLM",),
    served="`FlexOlmoForCausalLM` (FlexOlmo-7x7B-1T)",
    adds=("OLMo 2's layer (norms on each branch's output, query/key norms over all heads) with OLMoE's sparse MLP "
          "in every layer (experts of `intermediate_size`, weighed by the softmax over all unless "
          "`norm_topk_prob`)"),
    cpu="as OLMoE",
    gpu="as OLMoE",
    tests=("flex_olmo",),
    traits=("qk_norm_over_heads", "post_normed", "qk_norm", "sandwich_norms"),
    config_class="flex_olmo",
)


OLMO_HYBRID = Family(
    name="OLMo Hybrid",
    architectures=("OlmoHybridForCausalLM",),
    served="`OlmoHybridForCausalLM`",
    adds=("Qwen3.5's Gated DeltaNet (layers/gated_delta_net.py) where `layer_types` says linear_attention, its q, "
          "k and v products and their convolutions apart in the checkpoint (`q_proj`..., `q_conv1d`...: fused at "
          "load in that order, as transformers concatenates them), as many key heads as value heads (refused "
          "otherwise by name), beta times 2 where `linear_allow_neg_eigval` (the state's eigenvalues down to -1), "
          "its output norm's eps 1e-5 and plain w; those layers normed as a Llama's (`attention_layer_norm`, "
          "`feedforward_layer_norm`: transformers' renames), the full attention layers as OLMo 2's (each branch's "
          "output normed, query/key norms over all heads; `post_normed_layers`), rotary where the config has a "
          "base (NoPE where none)"),
    cpu=("as Qwen3.5 (bfloat16 held to transformers' own bfloat16 error, as the other Gated DeltaNet and Mamba2 "
         "hybrids)"),
    gpu="as Qwen3.5",
    tests=("olmo_hybrid",),
    traits=("unclassified", "qk_norm_over_heads", "qk_norm"),
    config_class="olmo_hybrid",
    weight_names={".attention_layer_norm.": ".input_layernorm.",
                  ".feedforward_layer_norm.": ".post_attention_layernorm.",
                  ".linear_attn.o_norm.weight": ".self_attn.norm_weight",
                  ".linear_attn.g_proj.": ".self_attn.in_proj_z.",
                  ".linear_attn.a_proj.": ".self_attn.in_proj_a.",
                  ".linear_attn.b_proj.": ".self_attn.in_proj_b.",
                  ".linear_attn.o_proj.": ".self_attn.out_proj.",
                  ".linear_attn.": ".self_attn."},
    tensor_fixups=("olmo_hybrid",),
)


FAMILIES = (OLMO_2, OLMO_3, OLMOE, FLEXOLMO, OLMO_HYBRID)
