"""Hybrid families' config: which layers keep a recurrent state in place of KV blocks and
their mixer's dims (Qwen3.5's and OLMo Hybrid's Gated DeltaNet, LFM2's short
convolutions, Granite 4.0-H's, Bamba's and Nemotron-H's Mamba2)."""

from __future__ import annotations

import math

from services.worker.models.families.registry import (
    LINEAR_ATTENTION,
    MAMBAS,
    OLMO_HYBRID,
    SHORT_CONVS,
)


def nemotron_h(raw: dict) -> dict:
    """Nemotron-H's config (transformers' NemotronHConfig, defaults filled in, its blocks
    by layers_block_type: linear_attention for Mamba2, full_attention, mlp, moe) in the
    names the rest of this reader takes: Granite 4.0-H's for Mamba2, its MLP's activation,
    its norms' eps. Its mixture-of-experts blocks (Nemotron 3) are refused by name."""
    kinds = raw.get("layers_block_type") or raw["layer_types"]
    if "moe" in kinds:
        raise ValueError("unsupported Nemotron-H mixture-of-experts blocks (moe in layers_block_type, Nemotron 3): "
                         "Mamba2, attention and MLP blocks only")
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported mamba_hidden_act {raw['mamba_hidden_act']!r} for Nemotron-H: silu")
    heads, head_dim = raw["mamba_num_heads"], raw["mamba_head_dim"]
    return {**raw, "layer_types": list(kinds), "num_hidden_layers": len(kinds), "hidden_act": raw.get("mlp_hidden_act", "relu2"),
            "rms_norm_eps": raw["layer_norm_epsilon"], "mamba_n_heads": heads, "mamba_d_head": head_dim,
            "mamba_expand": heads * head_dim / raw["hidden_size"], "mamba_d_state": raw["ssm_state_size"],
            "mamba_n_groups": raw["n_groups"], "mamba_d_conv": raw["conv_kernel"],
            "mamba_conv_bias": raw.get("use_conv_bias", True),
            "mamba_proj_bias": raw.get("mamba_proj_bias", raw.get("use_bias", False))}


def mamba_fields(arch: str, raw: dict) -> dict:
    """Granite 4.0-H's and Bamba's hybrid layers (transformers' GraniteMoeHybridConfig,
    BambaConfig, defaults filled in, layer_types standardized: "mamba" read as
    linear_attention; Bamba's from attn_layer_indices): Mamba2 mixers where
    linear_attention, attention elsewhere."""
    if arch not in MAMBAS:
        return {}
    num_layers = raw["num_hidden_layers"]
    attending = set(raw.get("attn_layer_indices") or ())
    kinds = raw.get("layer_types") or ["full_attention" if i in attending else "linear_attention"
                                       for i in range(num_layers)]
    blocks = arch == "NemotronHForCausalLM"  # (a block of one branch each: an MLP block among them)
    check_layer_kinds(kinds, num_layers, {"linear_attention", "full_attention", *(["mlp"] * blocks)})
    heads, head_dim, groups = raw["mamba_n_heads"], raw["mamba_d_head"], raw["mamba_n_groups"]
    if heads * head_dim != raw["mamba_expand"] * raw["hidden_size"] or heads % groups or raw["mamba_d_conv"] < 2:
        raise ValueError(f"unsupported Mamba2 dims: {heads} heads of {head_dim} (mamba_expand * hidden_size "
                         f"{raw['mamba_expand'] * raw['hidden_size']}), {groups} groups, a convolution "
                         f"{raw['mamba_d_conv']} wide")
    limit = tuple(float(x) for x in (raw.get("time_step_limit") or (0.0, math.inf)))
    one_branch = dict(mixerless_layers=tuple(i for i, kind in enumerate(kinds) if kind == "mlp"),
                      mlpless_layers=tuple(i for i, kind in enumerate(kinds) if kind != "mlp")) if blocks else {}
    return dict(one_branch, recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
                recurrent_mixer="mamba2", mamba_num_heads=heads, mamba_head_dim=head_dim,
                mamba_state_size=raw["mamba_d_state"], mamba_num_groups=groups, mamba_conv_kernel=raw["mamba_d_conv"],
                mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
                mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)), mamba_dt_limit=limit)


def check_layer_kinds(kinds: list[str], num_layers: int, allowed: set[str]) -> None:
    """A hybrid's layer_types: one of `allowed` for each layer."""
    if len(kinds) != num_layers or not set(kinds) <= allowed:
        raise ValueError(f"layer_types must name {' or '.join(sorted(allowed))} for each of {num_layers} layers")


def lfm2(raw: dict) -> dict:
    """LFM2's config (transformers' Lfm2Config, defaults filled in) in the names the rest of
    this reader takes: its norms' eps, and its MLP's size as its class computes it from
    intermediate_size (two thirds of it, times block_ffn_dim_multiplier, rounded up to
    block_multiple_of)."""
    size = raw["intermediate_size"]
    if raw.get("block_auto_adjust_ff_dim"):
        size = int(2 * size / 3)
        if raw.get("block_ffn_dim_multiplier") is not None:
            multiple = raw["block_multiple_of"]
            size = multiple * ((int(raw["block_ffn_dim_multiplier"] * size) + multiple - 1) // multiple)
    return {**raw, "intermediate_size": size, "rms_norm_eps": raw["norm_eps"]}


def short_conv_fields(arch: str, raw: dict) -> dict:
    """LFM2's hybrid layers: a gated short convolution where `layer_types` says conv, full
    attention (Qwen3's per-head query/key norms) elsewhere."""
    if arch not in SHORT_CONVS:
        return {}
    kinds = raw["layer_types"]
    lfm3 = arch == "Lfm3ForCausalLM"
    check_layer_kinds(kinds, raw["num_hidden_layers"], {"conv", "full_attention", *(("sliding_attention",) if lfm3 else ())})
    if raw["conv_L_cache"] < 2:
        raise ValueError(f"unsupported conv_L_cache {raw['conv_L_cache']}: a convolution at least 2 wide")
    if lfm3 and not raw.get("use_sandwich_norm", True):
        raise ValueError("unsupported use_sandwich_norm false for LFM3: its four norms a layer only")
    window = raw.get("sliding_window") if lfm3 else None
    if "sliding_attention" in kinds and not (window and window >= 1):
        raise ValueError(f"sliding_window {window} must be at least 1 for LFM3's sliding layers")
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds) if window else ()
    return dict(recurrent_layers=tuple(i for i, kind in enumerate(kinds) if kind == "conv"),
                recurrent_mixer="short_conv", short_conv_kernel=int(raw["conv_L_cache"]),
                short_conv_bias=bool(raw.get("conv_bias")),
                **({"layer_windows": windows} if any(windows) else {}))


def linear_attention_fields(arch: str, raw: dict) -> dict:
    """Qwen3.5's hybrid layers (transformers' Qwen3_5TextConfig, defaults filled in): the
    Gated DeltaNet where `layer_types` says linear_attention, full attention elsewhere,
    its heads' outputs gated by half of q_proj's rows (attention_gate), Qwen3's per-head
    query/key norms (qk_norm), Gemma's 1 + w norms. OLMo Hybrid's (transformers'
    OlmoHybridConfig): the same layers, as many key heads as value heads, beta up to 2
    where linear_allow_neg_eigval, the output norm's eps 1e-5, its attention layers normed
    as OLMo 2's (post_normed_layers) and the others as a Llama's, plain w norms."""
    if arch not in (*LINEAR_ATTENTION, OLMO_HYBRID):
        return {}
    kinds = raw["layer_types"]
    check_layer_kinds(kinds, raw["num_hidden_layers"], {"linear_attention", "full_attention"})
    fields = {k: int(raw[k]) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim", "linear_conv_kernel_dim")}
    if min(fields.values()) < 1 or fields["linear_num_value_heads"] % fields["linear_num_key_heads"] \
            or fields["linear_conv_kernel_dim"] < 2:
        raise ValueError(f"unsupported linear attention dims {fields}: value heads a multiple of key heads, "
                         "a convolution at least 2 wide")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} for {arch}: silu")
    if raw.get("attention_bias"):  # (q_proj's bias would be split between queries and gates)
        raise ValueError(f"unsupported attention_bias true for {arch}: attention without biases only")
    recurrent = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    if arch == OLMO_HYBRID:
        if fields["linear_num_key_heads"] != fields["linear_num_value_heads"]:
            raise ValueError(f"unsupported linear attention heads {fields}: OLMo Hybrid's as many key heads as value "
                             "heads (its transformers class pairs them one to one)")
        return dict(fields, recurrent_layers=recurrent, recurrent_mixer="gated_delta_net",
                    linear_beta_scale=2.0 if raw.get("linear_allow_neg_eigval", True) else 1.0, linear_norm_eps=1e-5,
                    post_normed_layers=tuple(i for i, kind in enumerate(kinds) if kind == "full_attention"))
    return dict(fields, recurrent_layers=recurrent, recurrent_mixer="gated_delta_net", norm_weight_offset=1.0)
