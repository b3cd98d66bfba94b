"""Mixture-of-experts families' config: which layers are sparse, how many experts of which
size, and how the router chooses and weighs them (Mixtral, Qwen2/3-MoE, GraniteMoe,
OLMoE, gpt-oss, DeepSeek-V2/V3 and the families on their router, Hunyuan, ERNIE 4.5,
LFM2-MoE, AFMoE, MiniMax-M2)."""

from __future__ import annotations

from services.worker.models.families.registry import DEEPSEEK_V3_MOES, GRANITE_HYBRID


def check_top_k(top_k: int, num_experts: int, key: str) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{key} {top_k} must be within 1..{num_experts} experts")


def check_silu_experts(raw: dict) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} with experts: only silu")


def moe_fields(arch: str, raw: dict) -> dict:
    """Mixtral: every layer sparse, experts of intermediate_size, top-k renormalized.
    Qwen3-MoE: layers sparse every decoder_sparse_step but mlp_only_layers, experts of
    moe_intermediate_size, renormalized if norm_topk_prob."""
    if arch in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        # Qwen2-MoE's sparse layers, a shared expert gated beside them; Qwen3.5-MoE's in
        # every layer, its router always renormalizing (transformers' Qwen3_5MoeTopKRouter)
        if arch == "Qwen3_5MoeForCausalLM":
            raw = {**raw, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
        return moe_fields("Qwen2MoeForCausalLM", raw)
    if arch == "GptOssForCausalLM":
        num_experts, top_k = raw["num_local_experts"], raw["num_experts_per_tok"]
        check_top_k(top_k, num_experts, "num_experts_per_tok")
        # (its hidden_act names no activation of its experts': theirs is their own)
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                    norm_topk_prob=True, moe_topk_softmax=True, moe_layers=tuple(range(raw["num_hidden_layers"])),
                    moe_bias=True, swiglu_alpha=float(raw["swiglu_alpha"]), swiglu_limit=float(raw["swiglu_limit"]))
    if arch in DEEPSEEK_V3_MOES:  # (GLM-4.7-Flash's config may leave its one MTP layer uncounted)
        return deepseek_v3_moe_fields(raw, mtp_layers=1 if arch == "Glm4MoeLiteForCausalLM" else 0)
    if arch == "DeepseekV2ForCausalLM":
        return deepseek_v2_moe_fields(raw)
    if arch == GRANITE_HYBRID:  # GraniteMoe's experts (where it has any) beside its shared MLP, unweighed
        if not raw.get("num_local_experts"):
            return {}
        return dict(moe_fields("GraniteMoeForCausalLM", raw), shared_expert_intermediate_size=raw["shared_intermediate_size"],
                    shared_expert_gated=False)
    if arch == "Lfm2MoeForCausalLM":
        # After num_dense_layers dense MLPs, experts chosen by sigmoid score plus the block's
        # expert_bias (where use_expert_bias), weighed by their scores, renormalized (their
        # sum + 1e-6) where norm_topk_prob says, times routed_scaling_factor; no shared expert
        num_experts, top_k = raw["num_experts"], raw["num_experts_per_tok"]
        check_top_k(top_k, num_experts, "num_experts_per_tok")
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                    norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                    moe_layers=tuple(range(raw.get("num_dense_layers") or 0, raw["num_hidden_layers"])),
                    moe_score_correction="sigmoid", moe_correction_bias=bool(raw.get("use_expert_bias", True)),
                    routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0), moe_norm_eps=1e-6)
    if arch == "AfmoeForCausalLM":
        check_silu_experts(raw)
        num_experts, top_k = raw["num_experts"], raw["num_experts_per_tok"]
        check_top_k(top_k, num_experts, "num_experts_per_tok")
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                    norm_topk_prob=True, moe_layers=tuple(range(raw.get("num_dense_layers") or 0, raw["num_hidden_layers"])),
                    shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("num_shared_experts") or 0),
                    shared_expert_gated=False, moe_score_correction="sigmoid",
                    routed_scaling_factor=float(raw.get("route_scale") or 1.0))
    if arch == "ExaoneMoeForCausalLM":  # (DeepSeek-V3's experts under names of its own; its MTP is mtp.*, no layer)
        raw = {**raw, "n_routed_experts": raw["num_experts"], "n_shared_experts": raw.get("num_shared_experts")}
        return dict(deepseek_v3_moe_fields(raw), skipped_layers=0)
    if arch == "Mistral4ForCausalLM":  # (DeepSeek-V3's experts chosen by softmax score alone: no correction bias)
        return dict(deepseek_v3_moe_fields(raw), moe_score_correction="softmax", moe_correction_bias=False)
    if arch == "HunYuanMoEV1ForCausalLM":
        return hunyuan_moe_fields(raw)
    if arch == "Ernie4_5_MoeForCausalLM":
        return ernie_moe_fields(raw)
    if arch == "MiniMaxM2ForCausalLM":  # (its scores renormalized always: transformers' router has no switch)
        return dict(moe_fields("MixtralForCausalLM", raw), moe_score_correction="sigmoid")
    if arch in ("OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        if raw.get("clip_qkv") is not None:
            raise ValueError(f"unsupported clip_qkv {raw['clip_qkv']} for {arch}: unclipped queries, keys and values only")
        raw = {**raw, "moe_intermediate_size": raw["intermediate_size"]}  # (its experts are of the dense size)
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM",
                    "OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        return {}
    check_silu_experts(raw)
    num_experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    top_k = raw.get("num_experts_per_tok", 0)
    check_top_k(top_k, num_experts, "num_experts_per_tok")
    layers = range(raw["num_hidden_layers"])
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                    norm_topk_prob=True, moe_layers=tuple(layers), moe_topk_softmax=arch == "GraniteMoeForCausalLM")
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
    if step < 1:
        raise ValueError(f"decoder_sparse_step {step} must be at least 1")
    shared = (raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                moe_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
                shared_expert_intermediate_size=shared)


def deepseek_v3_moe_fields(raw: dict, mtp_layers: int = 0) -> dict:
    """DeepSeek-V3's experts (transformers' DeepseekV3MoE), GLM-4.5's and dots.llm1's: dense
    layers before first_k_dense_replace (or as mlp_layer_types says, GLM-4.7-Flash's), then
    sparse ones of n_routed_experts, DeepSeek-V3's router, and n_shared_experts ungated
    shared experts (one MLP of their summed size); the multi-token-prediction layers past
    the last skipped, num_nextn_predict_layers of them (`mtp_layers` where the config leaves
    the count out: GLM-4.7-Flash's, whose one transformers skips by name)."""
    check_silu_experts(raw)
    num_experts, top_k = raw["n_routed_experts"], raw["num_experts_per_tok"]
    groups, top_groups = raw.get("n_group") or 1, raw.get("topk_group") or 1
    check_top_k(top_k, num_experts, "num_experts_per_tok")
    if num_experts % groups or num_experts // groups < 2 or not 0 < top_groups <= groups:
        raise ValueError(f"n_group {groups} and topk_group {top_groups} must split {num_experts} experts into groups "
                         "of at least 2 and keep some")
    if top_k > top_groups * (num_experts // groups):
        raise ValueError(f"num_experts_per_tok {top_k} is more than the {top_groups} kept groups hold")
    kinds = raw.get("mlp_layer_types")  # (GLM-4.7-Flash's: "dense" or "sparse" a layer)
    if kinds is not None and (len(kinds) != raw["num_hidden_layers"] or set(kinds) - {"dense", "sparse"}):
        raise ValueError(f"unsupported mlp_layer_types {kinds!r}: 'dense' or 'sparse' for each of the "
                         f"{raw['num_hidden_layers']} layers")
    sparse = [i for i, kind in enumerate(kinds) if kind == "sparse"] if kinds is not None \
        else range(raw.get("first_k_dense_replace") or 0, raw["num_hidden_layers"])  # (Solar Open's: none dense)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=bool(raw["norm_topk_prob"]),  # (transformers' default filled in: GLM's on, dots' off)
                moe_layers=tuple(sparse),
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
                shared_expert_gated=False, moe_score_correction="sigmoid", moe_num_groups=groups, moe_topk_groups=top_groups,
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                skipped_layers=raw.get("num_nextn_predict_layers", mtp_layers) or 0)


def deepseek_v2_moe_fields(raw: dict) -> dict:
    """DeepSeek-V2's experts (transformers' DeepseekV2Moe): dense layers before
    first_k_dense_replace, then sparse ones: the top k of n_routed_experts by softmax score
    (topk_method "greedy"), or among the best topk_group of n_group groups, a group ranked by
    its best score ("group_limited_greedy"), weighed by their scores times
    routed_scaling_factor, never renormalized (transformers' router has no switch for it: a
    config asking for it is refused, where vLLM's would renormalize), beside n_shared_experts
    ungated shared experts."""
    check_silu_experts(raw)
    if raw.get("norm_topk_prob"):
        raise ValueError("unsupported norm_topk_prob true for DeepSeek-V2: its router's weights unnormalized only")
    if raw.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias true for DeepSeek-V2: unbiased MLPs only")
    method = raw.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported topk_method {method!r} for DeepSeek-V2: greedy or group_limited_greedy")
    grouped = method == "group_limited_greedy"
    num_experts, top_k = raw["n_routed_experts"], raw["num_experts_per_tok"]
    groups, top_groups = (raw.get("n_group") or 1, raw.get("topk_group") or 1) if grouped else (1, 1)
    check_top_k(top_k, num_experts, "num_experts_per_tok")
    if grouped and (num_experts % groups or not 0 < top_groups <= groups or top_k > top_groups * (num_experts // groups)):
        raise ValueError(f"n_group {groups} and topk_group {top_groups} must split {num_experts} experts into groups "
                         f"whose kept ones hold num_experts_per_tok {top_k}")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                moe_layers=tuple(range(raw["first_k_dense_replace"], raw["num_hidden_layers"])),
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
                shared_expert_gated=False, moe_score_correction="softmax", moe_correction_bias=False,
                moe_group_by_max=True, moe_num_groups=groups, moe_topk_groups=top_groups,
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))


def hunyuan_moe_fields(raw: dict) -> dict:
    """Hunyuan MoE (transformers' HunYuanMoEV1Moe): every layer sparse, experts and the shared
    MLP of intermediate_size; `num_experts` and `moe_topk` may be given a layer each (the
    checkpoints repeat one value: anything else is refused)."""
    def one(key: str) -> int:
        value = raw[key]
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"unsupported {key} {value}: one value for every layer only")
            value = value[0]
        return int(value)

    num_experts, top_k = one("num_experts"), one("moe_topk")
    check_top_k(top_k, num_experts, "moe_topk")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                norm_topk_prob=True, moe_layers=tuple(range(raw["num_hidden_layers"])),
                shared_expert_intermediate_size=raw["intermediate_size"], shared_expert_gated=False,
                moe_router_float32=True)


def ernie_moe_fields(raw: dict) -> dict:
    """ERNIE 4.5 MoE (transformers' Ernie4_5_MoeSparseMoeBlock): sparse layers every
    moe_layer_interval from moe_layer_start_index to moe_layer_end_index, experts of
    moe_intermediate_size chosen by softmax probability + a correction bias, weighed by the
    probabilities renormalized (their sum floored at moe_norm_min), and
    moe_num_shared_experts ungated shared experts (one MLP of their summed size)."""
    if raw.get("use_bias"):
        raise ValueError("unsupported use_bias true for ERNIE 4.5 MoE: unbiased projections only")
    check_silu_experts(raw)
    num_experts, top_k = raw["moe_num_experts"], raw["moe_k"]
    check_top_k(top_k, num_experts, "moe_k")
    interval, start, end = raw["moe_layer_interval"], raw["moe_layer_start_index"], raw["moe_layer_end_index"]
    if interval < 1:
        raise ValueError(f"moe_layer_interval {interval} must be at least 1")
    layers = tuple(i for i in range(raw["num_hidden_layers"]) if (i + 1) % interval == 0 and start <= i <= end)
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=True, moe_layers=layers,
                shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("moe_num_shared_experts") or 0),
                shared_expert_gated=False, moe_score_correction="softmax", moe_norm_min=float(raw["moe_norm_min"]),
                moe_router_float32=True)
