"""Tencent's Hunyuan, dense and MoE: query/key norms after rotary, an NTK alpha on the rotary base."""

from __future__ import annotations

from services.worker.models.families.family import Family

# Hunyuan's query/key norms, router and shared MLP under names of their own
_HUNYUAN_NAMES = {".query_layernorm.": ".q_norm.",
                  ".key_layernorm.": ".k_norm.",
                  ".mlp.gate.wg.": ".mlp.gate.",
                  ".mlp.shared_mlp.": ".mlp.shared_expert."}

HUNYUAN = Family(
    name="Hunyuan",
    architectures=("HunYuanDenseV1ForCausalLM",),
    served="`HunYuanDenseV1ForCausalLM` (Hunyuan-0.5B to 7B)",
    adds=("a Llama whose per-head query/key norms (`query_layernorm`, `key_layernorm`) come after rotary, not "
          "before (Qwen3's order); `dynamic` rope with an NTK `alpha`: a fixed base, `rope_theta * alpha ** "
          "(head_dim / (head_dim - 2))`, as transformers computes it"),
    cpu="all dtypes and int8/int4 on the module path (the one-call layer norms before rotary, so it steps aside)",
    gpu="as Llama, the rotary not fused with the cache write (the norms come between)",
    tests=("hunyuan",),
    traits=("hunyuan", "qk_norm"),
    config_class="hunyuan_v1_dense",
    weight_names=_HUNYUAN_NAMES,
)


HUNYUAN_MOE = Family(
    name="Hunyuan MoE",
    architectures=("HunYuanMoEV1ForCausalLM",),
    served="`HunYuanMoEV1ForCausalLM` (Hunyuan-A13B)",
    adds=("Hunyuan's attention (query/key norms after rotary, the NTK `alpha`); every layer sparse: a router "
          "(`mlp.gate.wg`, kept float32 and run in float32 in every dtype, as transformers keeps it) softmax over "
          "all experts, top `moe_topk` renormalized, experts of `intermediate_size`, beside a shared MLP "
          "(`mlp.shared_mlp`) of the same size added unweighed; `num_experts` and `moe_topk` given a layer each "
          "are read where every layer has the same"),
    cpu="as Mixtral",
    gpu="as Mixtral",
    tests=("hunyuan_moe",),
    traits=("hunyuan", "unclassified", "qk_norm"),
    config_class="hunyuan_v1_moe",
    weight_names=_HUNYUAN_NAMES,
)


FAMILIES = (HUNYUAN, HUNYUAN_MOE)
