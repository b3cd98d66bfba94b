"""Arcee's families: AFM (an ungated relu2 MLP) and AFMoE (Trinity: gated attention outputs, Gemma
2's four norms, experts)."""

from __future__ import annotations

from services.worker.models.families.family import Family

ARCEE = Family(
    name="Arcee",
    architectures=("ArceeForCausalLM",),
    served="`ArceeForCausalLM` (AFM-4.5B)",
    adds=("a Llama whose MLP has no gate: `down(relu(up x) ** 2)` (`hidden_act` relu2), its `gate_up_proj` the up "
          "rows alone; LoRA adapters of its attention and `down_proj` (one of `up_proj` refused by name)"),
    cpu="all dtypes and int8/int4 on the module path (the one-call layer's MLP is gated)",
    gpu="as Llama, the activation in PyTorch",
    tests=("arcee",),
    config_class="arcee",
    ungated_acts=("relu2",),
)


AFMOE = Family(
    name="AFMoE",
    architectures=("AfmoeForCausalLM",),
    # (muP: the embeddings times sqrt(hidden_size))
    fields=lambda raw: {"embedding_multiplier": raw["hidden_size"] ** 0.5} if raw.get("mup_enabled") else {},
    served="`AfmoeForCausalLM` (Arcee's Trinity Mini, Nano, Large)",
    adds=("Qwen3's per-head query/key norms; the heads' output gated by a sigmoid of the attention's own input "
          "(`self_attn.gate_proj`, before o_proj); windowed layers by `layer_types` (from "
          "`global_attn_every_n_layers`), only they rotating, the global ones NoPE; Gemma 2's four norms "
          "(`pre_mlp_layernorm`, `post_mlp_layernorm`); muP's embedding scale where `mup_enabled`; after "
          "`num_dense_layers` dense layers, experts by sigmoid score plus a correction bias (`mlp.expert_bias`, "
          "float32), renormalized, times `route_scale`, beside shared experts (in bfloat16 transformers keeps the "
          "norms float32; here they take the model's dtype)"),
    cpu="as Mixtral (the one-call layer steps aside: it has no gate)",
    gpu="as Mixtral, the gate in PyTorch",
    tests=("afmoe",),
    traits=("unclassified", "always_windowed_by_layer_type", "windowed", "qk_norm", "sandwich_norms",
           "attention_gate"),
    config_class="afmoe",
    weight_names={".pre_mlp_layernorm.": ".pre_feedforward_layernorm.",
                  ".post_mlp_layernorm.": ".post_feedforward_layernorm.",
                  ".mlp.router.gate.": ".mlp.gate.",
                  ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
                  ".mlp.shared_experts.": ".mlp.shared_expert.",
                  ".self_attn.gate_proj.": ".self_attn.output_gate."},
)


FAMILIES = (ARCEE, AFMOE)
