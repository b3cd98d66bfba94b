"""Baidu's ERNIE 4.5, dense and MoE: interleaved rotary, a router with a correction bias every few
layers."""

from __future__ import annotations

from services.worker.models.families.family import Family

ERNIE_4_5 = Family(
    name="ERNIE 4.5",
    architectures=("Ernie4_5ForCausalLM",),
    served="`Ernie4_5ForCausalLM` (the dense ERNIE-4.5-0.3B, its `-PT` checkpoints)",
    adds=("a Llama rotating interleaved pairs, reordered at load as GLM's; `use_bias` biases every projection, the"
          " MLP's too (as a Llama config's `mlp_bias` does); tied; config defaults from transformers' class"),
    cpu=("all dtypes and int8/int4; the one-call decode layer where the MLP has no biases (`use_bias: false`, the "
         "released checkpoints)"),
    gpu="as Llama",
    tests=("ernie4_5",),
    traits=("rotary_interleaved",),
    config_class="ernie4_5",
)


ERNIE_4_5_MOE = Family(
    name="ERNIE 4.5 MoE",
    architectures=("Ernie4_5_MoeForCausalLM",),
    served="`Ernie4_5_MoeForCausalLM` (ERNIE-4.5-21B-A3B, 300B-A47B)",
    adds=("ERNIE 4.5's layer (interleaved rotary, tied); sparse layers every `moe_layer_interval` from "
          "`moe_layer_start_index` to `moe_layer_end_index`: a router kept in float32 whatever the model's dtype "
          "(as transformers keeps it), experts chosen by softmax probability plus the learned correction bias "
          "(`moe_statics`, read as one row), weighed by the probabilities renormalized (their sum floored at "
          "`moe_norm_min`), beside `moe_num_shared_experts` ungated shared experts; `use_bias` refused by name"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("ernie4_5_moe",),
    traits=("unclassified", "rotary_interleaved"),
    config_class="ernie4_5_moe",
    weight_names={".mlp.shared_experts.": ".mlp.shared_expert.", ".mlp.moe_statics.": ".mlp.gate."},
)


FAMILIES = (ERNIE_4_5, ERNIE_4_5_MOE)
