"""The LayerNorm decoders' config (GPT-2, OPT, GPT-NeoX, Phi, StarCoder2, StableLM, Jais 2,
Cohere): their own names for the usual fields, biases, parallel residuals, learned positions."""

from __future__ import annotations

from services.worker.models.families.registry import (
    COHERES,
    LAYER_NORMED,
    LEARNED_POSITIONS,
)


def layer_normed(arch: str, raw: dict) -> dict:
    """A LayerNorm decoder's config (as its transformers class fills it in) in the names the
    rest of this reader takes, where they differ; what the loader would mishandle refused."""
    raw = dict(raw)
    if arch == "GPT2LMHeadModel":
        for flag, runs in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
            if bool(raw.get(flag, runs)) != runs:
                raise ValueError(f"unsupported {flag} {raw.get(flag)!r} for GPT-2: {runs} only")
        raw.update(hidden_size=raw["n_embd"], num_hidden_layers=raw["n_layer"], num_attention_heads=raw["n_head"],
                   intermediate_size=raw.get("n_inner") or 4 * raw["n_embd"],
                   max_position_embeddings=raw["n_positions"], hidden_act=raw["activation_function"],
                   layer_norm_eps=raw["layer_norm_epsilon"])
    elif arch == "OPTForCausalLM":
        if not raw.get("do_layer_norm_before", True) or raw.get("_remove_final_layer_norm"):
            raise ValueError("unsupported OPT layer norms after each branch (do_layer_norm_before false: opt-350m): "
                             "before only")
        if raw.get("word_embed_proj_dim", raw["hidden_size"]) != raw["hidden_size"]:
            raise ValueError(f"unsupported OPT word_embed_proj_dim {raw['word_embed_proj_dim']} (projected "
                             f"embeddings: opt-350m): the hidden size {raw['hidden_size']} only")
        if not raw.get("layer_norm_elementwise_affine", True):
            raise ValueError("unsupported OPT layer_norm_elementwise_affine false: norms with weights only")
        raw.update(intermediate_size=raw["ffn_dim"], hidden_act=raw["activation_function"], layer_norm_eps=1e-5,
                   attention_bias=raw.get("enable_bias", True))
    elif arch in ("PhiForCausalLM", "StableLmForCausalLM") and raw.get("qk_layernorm"):
        raise ValueError(f"unsupported qk_layernorm true for {arch}: without query/key norms only")
    elif arch == "CohereForCausalLM" and raw.get("use_qk_norm"):
        raise ValueError("unsupported use_qk_norm true for Cohere (Command R+): without query/key norms only")
    raw["rms_norm_eps"] = raw.get("layer_norm_eps", raw.get("norm_epsilon", 1e-5))  # (the norms' eps, whatever the norm)
    if arch in ("OPTForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM"):
        # a head of keys and values to each query head, of hidden / heads dims, whatever
        # else the file holds
        raw["num_key_value_heads"] = raw["num_attention_heads"]
        raw.pop("head_dim", None)
    if arch == "OPTForCausalLM":  # (its enable_bias says for both)
        raw["mlp_bias"] = raw["attention_bias"]
    elif arch == "Starcoder2ForCausalLM":
        raw["attention_bias"] = raw["mlp_bias"] = raw.get("use_bias", True)
    elif arch == "StableLmForCausalLM":  # q/k/v's bias alone (o_proj never: attention_out_bias)
        raw["attention_bias"], raw["mlp_bias"] = bool(raw.get("use_qkv_bias")), False
    elif arch in COHERES:
        raw["mlp_bias"] = False
    elif arch == "Jais2ForCausalLM":  # (as its config says: both biased by default)
        raw["attention_bias"], raw["mlp_bias"] = bool(raw.get("attention_bias", True)), bool(raw.get("mlp_bias", True))
    else:  # (the MLPs of GPT-2, NeoX and Phi are always biased)
        raw["attention_bias"] = raw.get("attention_bias", True) if arch == "GPTNeoXForCausalLM" else True
        raw["mlp_bias"] = True
    return raw


def layer_normed_fields(arch: str, raw: dict) -> dict:
    if arch not in LAYER_NORMED:
        return {}
    biased = bool(raw.get("enable_bias", True)) if arch == "OPTForCausalLM" else arch not in COHERES
    parallel = (arch in ("PhiForCausalLM", *COHERES)
                or (arch in ("GPTNeoXForCausalLM", "StableLmForCausalLM")
                    and raw.get("use_parallel_residual", arch == "GPTNeoXForCausalLM")))
    fields = dict(layer_norm=True, norm_bias=biased, parallel_residual=parallel,
                  shared_norm=parallel and arch != "GPTNeoXForCausalLM", lm_head_bias=arch == "PhiForCausalLM",
                  scale_queries=arch == "OPTForCausalLM",
                  # StableLM's and Cohere's sum: the residual and the attention first, then the MLP
                  residual_first=parallel and arch in ("StableLmForCausalLM", *COHERES))
    if arch in COHERES:
        scale = float(raw.get("logit_scale", 1.0))
        if scale == 0:
            raise ValueError("logit_scale must not be 0")
        fields["logits_scaling"] = 1.0 / scale
    if arch in LEARNED_POSITIONS:
        offset = LEARNED_POSITIONS[arch]
        fields.update(position_embeddings=raw["max_position_embeddings"] + offset, position_offset=offset)
    return fields
