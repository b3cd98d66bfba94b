"""DeepSeek-V3's multi-head latent attention (and the families that share it), and Llama 4's
temperature by position on the queries (Ministral 3, Mistral 4)."""

from __future__ import annotations

import math

from services.worker.models.families.registry import (
    LATENT_ATTENTION,
    QUERIES_SCALED_BY_POSITION,
)


def query_scale_fields(arch: str, beta: float | None, rope: dict) -> dict:
    """Ministral 3's and Mistral 4's Llama 4 temperature: its beta, and the pretrained
    context it is counted in (the rope config's original_max_position_embeddings)."""
    if arch not in QUERIES_SCALED_BY_POSITION or not beta:
        return {}
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise ValueError(f"llama_4_scaling_beta {beta} for {arch} needs the rope config's "
                         "original_max_position_embeddings")
    return dict(query_scale_beta=float(beta), query_scale_original=int(original))


def latent_attention_fields(arch: str, raw: dict, rope: dict) -> dict:
    """DeepSeek-V3's latent attention (transformers' DeepseekV3Attention): its dims, and
    its softmax scale, 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times YaRN's mscale
    (of mscale_all_dim) squared, as transformers' yarn_apply_mscale makes it."""
    if arch not in LATENT_ATTENTION:
        return {}
    if raw.get("attention_bias"):
        raise ValueError(f"unsupported attention_bias true for {arch}: latent attention without biases only")
    dims = {k: int(raw[k] or 0) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim")}
    if min(dims["kv_lora_rank"], dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"]) < 1 \
            or dims["qk_rope_head_dim"] % 2:
        raise ValueError(f"unsupported latent attention dims {dims}: every one positive, qk_rope_head_dim even")
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    factor, m_all = rope.get("factor") or 1.0, rope.get("mscale_all_dim")
    if rope.get("rope_type", "default") != "default" and m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return dict(dims, attention_scale=scale)
