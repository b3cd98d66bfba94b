"""Liquid's LFM2, LFM2-MoE and LFM3: gated short convolutions between attention layers."""

from __future__ import annotations

from services.worker.models.families.family import Family

# (its final norm is called embedding_norm; its short convolutions are `self_attn` here; its
# MLPs' w1/w3/w2 read as Mixtral's experts' are)
_LFM2_NAMES = {"model.embedding_norm.": "model.norm.",
               ".operator_norm.": ".input_layernorm.",
               ".ffn_norm.": ".post_attention_layernorm.",
               ".feed_forward.expert_bias": ".mlp.gate.e_score_correction_bias",
               ".feed_forward.": ".mlp.",
               ".self_attn.out_proj.": ".self_attn.o_proj.",
               ".self_attn.q_layernorm.": ".self_attn.q_norm.",
               ".self_attn.k_layernorm.": ".self_attn.k_norm.",
               ".conv.": ".self_attn."}

LFM2 = Family(
    name="LFM2",
    architectures=("Lfm2ForCausalLM",),
    served="`Lfm2ForCausalLM` (LFM2-350M to 2.6B)",
    adds=("a hybrid: where `layer_types` says conv, a gated short convolution (layers/short_conv.py) in place of "
          "attention - one product makes B, C and x of the layer's input, B * x goes through a causal depthwise "
          "convolution `conv_L_cache` wide (layers/causal_conv.py, shared with Qwen3.5's DeltaNet), C gates it "
          "before `out_proj`; its state a request is that convolution's last inputs, a row each as Qwen3.5's (so, "
          "likewise, snapshots for the prefix cache, and no speculation or LoRA); the attention layers Qwen3's "
          "per-head query/key norms (`q_layernorm`, `k_layernorm`), its o_proj `out_proj`; the MLP's size as "
          "LFM2's class computes it (`block_auto_adjust_ff_dim`: two thirds of `intermediate_size`, times "
          "`block_ffn_dim_multiplier`, rounded up to `block_multiple_of`); its final norm `embedding_norm`; tied"),
    cpu=("all dtypes and int8/int4 on the module path (greedy agreement in bfloat16 in a Llama's band; the "
         "one-call decode layer steps aside)"),
    gpu="as Qwen3.5",
    tests=("lfm2",),
    traits=("short_conv", "unclassified", "qk_norm"),
    config_class="lfm2",
    weight_names=_LFM2_NAMES,
)


LFM2_MOE = Family(
    name="LFM2-MoE",
    architectures=("Lfm2MoeForCausalLM",),
    served="`Lfm2MoeForCausalLM` (LFM2-8B-A1B)",
    adds=("LFM2's layers; after `num_dense_layers` dense MLPs, experts chosen by sigmoid score plus the block's "
          "`expert_bias` (float32; where `use_expert_bias`), weighed by their scores, renormalized (their sum + "
          "1e-6, as its router adds) where `norm_topk_prob` says, times `routed_scaling_factor`; its experts under"
          " LFM2's names (`feed_forward.experts.N.w1/w3/w2`)"),
    cpu="as LFM2, the experts as Mixtral's",
    gpu="as LFM2, the experts as Mixtral's",
    tests=("lfm2_moe",),
    traits=("short_conv", "unclassified", "qk_norm"),
    config_class="lfm2_moe",
    weight_names=_LFM2_NAMES,
)


LFM3 = Family(
    name="LFM3",
    architectures=("Lfm3ForCausalLM",),
    fields=lambda raw: {"attention_gate": bool(raw.get("use_attention_gate", True)), "attention_gate_per_head": True},
    served="`Lfm3ForCausalLM` (LFM3-1.7B)",
    adds=("LFM2's short convolutions (7 wide by default) where `layer_types` says conv, and two kinds of attention"
          " beside them: `sliding_attention` layers (a window of `sliding_window`, the default rope of their own "
          "base) and `full_attention` layers with the proportional rope (every dim of a head turns, the "
          "frequencies past `partial_rotary_factor`'s share zero, over the whole head's exponents: "
          "layers/rotary.py); each head's output times a sigmoid of its own (`self_attn.gate_proj` [heads, "
          "hidden]: AFMoE's output gate, a head a gate, `attention_gate_per_head`); Gemma 2's four norms a layer "
          "(`post_operator_norm`, `post_ffn_norm`; `use_sandwich_norm: false` refused by name); the attention "
          "under Qwen3's names, the MLP LFM2's (`w1`/`w3`/`w2`) of `intermediate_size` as it stands"),
    cpu="as LFM2",
    gpu="as LFM2 (the window and the rope tables as Gemma 3's)",
    tests=("lfm3",),
    traits=("short_conv", "unclassified", "ropes_by_layer_type", "windowed", "qk_norm", "sandwich_norms"),
    config_class="lfm3",
    weight_names={".self_attn.gate_proj.": ".self_attn.output_gate.",
                  "model.embedding_norm.": "model.norm.",
                  ".operator_norm.": ".input_layernorm.",
                  ".post_operator_norm.": ".post_attention_layernorm.",
                  ".ffn_norm.": ".pre_feedforward_layernorm.",
                  ".post_ffn_norm.": ".post_feedforward_layernorm.",
                  ".feed_forward.": ".mlp.",
                  ".conv.": ".self_attn."},
)


FAMILIES = (LFM2, LFM2_MOE, LFM3)
