"""IBM's Granite families: four scalars on a Llama (Granite), its MoE, and the Mamba2 hybrids
Granite 4.0-H and Bamba."""

from __future__ import annotations

from services.worker.models.families.family import Family

GRANITE = Family(
    name="Granite",
    architectures=("GraniteForCausalLM",),
    served="`GraniteForCausalLM`",
    adds=("four scalars: `embedding_multiplier` on the looked-up rows (not folded into the table, which a tied "
          "head shares), `residual_multiplier` folded at load into `o_proj` and `down_proj` (each branch ends in "
          "that linear map, so every path runs it at no cost), `attention_multiplier` as the attention scale, "
          "`logits_scaling` dividing the logits (tested on logprobs: greedy output cannot see it)"),
    cpu="as Llama, the one-call decode layer included",
    gpu="as Llama",
    tests=("granite",),
)


GRANITEMOE = Family(
    name="GraniteMoe",
    architectures=("GraniteMoeForCausalLM",),
    served="`GraniteMoeForCausalLM` (granite-3.x-1b-a400m, 3b-a800m)",
    adds=("Granite's four scalars (the residual multiplier folded into every expert's `down_proj`); every layer "
          "sparse, the experts stacked in the checkpoint (`block_sparse_moe.input_linear` [experts, 2 × "
          "intermediate, hidden], `output_linear`; read one expert a row), the k chosen weighed by a softmax over "
          "their logits (`router.layer`), as transformers computes it"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("granite_moe",),
)


GRANITE_4_0_H = Family(
    name="Granite 4.0-H",
    architectures=("GraniteMoeHybridForCausalLM",),
    config_rewrites=("shared_mlp_when_dense",),
    served="`GraniteMoeHybridForCausalLM` (granite-4.0-h-micro, -h-tiny, -h-small)",
    adds=("a hybrid: where `layer_types` says mamba, Mamba2's selective state space (layers/mamba2.py) in place of"
          " attention - one product makes the gate z, x, B, C and a time step a head; x, B and C through a causal "
          "depthwise convolution with SiLU (layers/causal_conv.py); per head a [state, head_dim] state decayed by "
          "exp(dt A) (dt = softplus(dt + `dt_bias`) within `time_step_limit`, A = -exp(`A_log`)) taking B (dt x)^T"
          " each token, read by C, plus `D` x (layers/linear_recurrence.py, its prefill 64 tokens at a time in "
          "matrix products); times SiLU(z), RMS-normed by `mamba_n_groups` groups; the attention layers without "
          "positions (`position_embedding_type` other than rope: NoPE, as its checkpoints ship); Granite's four "
          "scalars (the residual multiplier folded into the mixers' `out_proj` too); GraniteMoe's experts beside "
          "the ungated `shared_mlp`, or that MLP alone where `num_local_experts` is 0 (H-Micro); its state a "
          "request as Qwen3.5's (snapshots for the prefix cache; no speculation or LoRA); `time_step_limit`'s "
          'infinity as transformers 5 writes it (`{"__float__": "Infinity"}`) read'),
    cpu=("float32 as transformers in every scheduling mode; bfloat16 and int8/int4 run, held as Qwen3.5's (prompt "
         "logprobs within twice transformers' own bfloat16 error); the one-call decode layer steps aside"),
    gpu="as Qwen3.5 (the experts as Mixtral's)",
    tests=("granite_hybrid", "granite_hybrid_dense"),
    traits=("mamba", "unclassified"),
    config_class="granitemoehybrid",
    weight_names={".mamba.norm.weight": ".self_attn.norm_weight", ".mamba.": ".self_attn."},
    tensor_fixups=("granite_hybrid",),
)


BAMBA = Family(
    name="Bamba",
    architectures=("BambaForCausalLM",),
    served="`BambaForCausalLM` (Bamba-9B)",
    adds=("Granite 4.0-H's Mamba2 layers beside attention layers (`attn_layer_indices`) that rotate (half of each "
          "head by default), each layer with a Llama MLP (`feed_forward`, its input norm `pre_ff_layernorm`; the "
          "final norm `final_layernorm`)"),
    cpu="as Granite 4.0-H",
    gpu="as Granite 4.0-H",
    tests=("bamba",),
    traits=("mamba", "unclassified"),
    config_class="bamba",
    weight_names={".mamba.norm.weight": ".self_attn.norm_weight",
                  ".mamba.": ".self_attn.",
                  ".feed_forward.": ".mlp.",
                  ".pre_ff_layernorm.": ".post_attention_layernorm.",
                  "model.final_layernorm.": "model.norm."},
)


FAMILIES = (GRANITE, GRANITEMOE, GRANITE_4_0_H, BAMBA)
