"""Gemma 1-3 and VaultGemma's config: norms by 1 + w, scaled embeddings, Gemma 2's soft caps
and output norms, alternating windows, Gemma 3's base of its own for windowed layers;
Granite's four scalars."""

from __future__ import annotations

from services.worker.models.config_reader import layer_windows
from services.worker.models.families.registry import GEMMAS, GRANITE_HYBRID


def gemma_fields(arch: str, raw: dict) -> dict:
    if arch not in GEMMAS:
        return {}
    fields = dict(embedding_multiplier=raw["hidden_size"] ** 0.5, embedding_multiplier_in_dtype=True,
                  norm_weight_offset=1.0)
    if arch != "GemmaForCausalLM":
        fields.update(windowed_gemma_fields(raw, pattern=6 if arch == "Gemma3ForCausalLM" else 2))
    if arch == "VaultGemmaForCausalLM":  # (Gemma 2's layer without its two output norms)
        fields["sandwich_norms"] = False
    return fields


def ropes_by_layer_type(raw: dict) -> tuple[dict, float]:
    """Two rotary setups: the global layers' as every family's (Gemma 3's: rope_theta,
    default 1e6, with rope_scaling; OLMo 3's: its YaRN), the windowed layers' base apart
    (default rope; Gemma 3's rope_local_base_freq, default 1e4). transformers 5 writes
    both in rope_parameters, by layer type."""
    by_type = raw.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        full = dict(by_type.get("full_attention") or {})
        local = dict(by_type.get("sliding_attention") or {})
    else:
        full = dict(raw.get("rope_scaling") or {})
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope_type {local.get('rope_type')!r} for Gemma 3's sliding layers: default")
    raw = {**raw, "rope_parameters": full}
    raw.pop("rope_scaling", None)
    return raw, float(local.get("rope_theta", 10000.0))


def windowed_gemma_fields(raw: dict, pattern: int) -> dict:
    """Which layers slide (`layer_types`, or transformers' default from the pattern: all but
    every `pattern`-th layer - Gemma 2 every other, Gemma 3 five in six), the caps, and the
    attention scale from query_pre_attn_scalar rather than head_dim."""
    num_layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
    pattern = raw.get("sliding_window_pattern", pattern)
    kinds = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)]
    windows = layer_windows(kinds, window, num_layers)
    caps = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = raw.get(name)
        if cap is not None and cap <= 0:
            raise ValueError(f"{name} {cap} must be positive (or null: no cap)")
        caps[name] = None if cap is None else float(cap)
    scalar = raw.get("query_pre_attn_scalar") or raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return dict(layer_windows=windows, sandwich_norms=True,
                attention_scale=float(scalar) ** -0.5, **caps)


def granite_fields(arch: str, raw: dict) -> dict:
    if arch not in ("GraniteForCausalLM", "GraniteMoeForCausalLM", GRANITE_HYBRID):
        return {}
    fields = dict(embedding_multiplier=raw.get("embedding_multiplier", 1.0),
                  residual_multiplier=raw.get("residual_multiplier", 1.0),
                  attention_scale=raw.get("attention_multiplier", 1.0),  # transformers' default too
                  logits_scaling=raw.get("logits_scaling", 1.0))
    if fields["logits_scaling"] == 0:
        raise ValueError("logits_scaling must not be 0")
    return {name: float(value) for name, value in fields.items()}
