"""A config's rotary embedding as llmbus runs it: its base, its scaling (default, linear,
llama3, longrope, yarn, proportional; dynamic NTK read as the default it is within the
context served), how many of a head's dims rotate, longrope's threshold, and Llama 4's
query temperature beta where the rope config carries one."""

from __future__ import annotations

from services.worker.models.families.registry import HUNYUANS


def read_rope(arch: str, raw: dict, head_dim: int) -> tuple[float, dict, int, int | None, float | None]:
    """(rope_theta, rope_scaling with its rope_type, rotary_dim, long_rope_threshold,
    llama_4_scaling_beta) of a config, or a ValueError naming what is not supported."""
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta`
    # beside an optional `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    beta = rope.pop("llama_4_scaling_beta", None)  # (read by the families whose transformers class reads it)
    if arch in HUNYUANS and rope_type == "dynamic" and rope.get("alpha"):
        # Hunyuan's NTK alpha: a fixed, larger base (transformers' ntk_alpha), whatever the length
        theta = theta * rope.pop("alpha") ** (head_dim / (head_dim - 2))
    if rope_type == "dynamic":
        # Dynamic NTK (InternLM3's): transformers raises the base only for a sequence past
        # max_position_embeddings, and at that length or under its factor leaves the
        # default frequencies bit for bit; llmbus never serves past it (max_model_len).
        # (Hunyuan's alpha, a fixed base whatever the length, is in theta by now.)
        rope = {"rope_type": "default"}
        rope_type = "default"
    if rope_type not in ("default", "linear", "llama3", "longrope", "yarn", "proportional"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: default, linear, llama3, yarn, longrope or "
                         "proportional")
    rope["rope_type"] = rope_type
    # Qwen-VL's MRoPE: on text, the ordinary rotary (TEXT_MODELS_OF), its sections unread
    for key in ("type", "mrope_section", "mrope_interleaved"):
        rope.pop(key, None)
    # proportional (LFM3's full layers): every dim turns, the frequencies past
    # partial_rotary_factor's share zero (layers/rotary.py), so its factor stays with them
    partial = 1.0 if rope_type == "proportional" else rope.pop("partial_rotary_factor",
                                                                 raw.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"unsupported partial_rotary_factor {partial}: {rotary_dim} of {head_dim} dims rotate")
    long_rope_threshold = None
    if rope_type == "longrope":
        original = rope.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
        if original is None or len(rope.get("short_factor", ())) != rotary_dim // 2 \
                or len(rope.get("long_factor", ())) != rotary_dim // 2:
            raise ValueError("longrope needs original_max_position_embeddings and short_factor and "
                             f"long_factor of {rotary_dim // 2} values each")
        rope["original_max_position_embeddings"] = long_rope_threshold = original
        # transformers' attention factor: from `factor`, or the ratio of the two lengths
        rope.setdefault("factor", raw.get("max_position_embeddings", 2048) / original)
    if rope_type == "yarn":  # as transformers standardizes it: the pretrained length, the factor from it
        original = raw.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
            or raw.get("max_position_embeddings", 2048)
        rope["original_max_position_embeddings"] = original
        if rope.get("factor") is None:
            rope["factor"] = raw.get("max_position_embeddings", 2048) / original
    return theta, rope, rotary_dim, long_rope_threshold, beta
