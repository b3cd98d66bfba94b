"""Rewrites of a family's raw config.json before the common reading, by the name a family's
record gives (Family.config_rewrites): where a family says a thing its own way."""

from __future__ import annotations

from collections.abc import Callable

from services.worker.models.config_fields.hybrid import nemotron_h


def sparse_every_layer(raw: dict) -> dict:
    """Every layer sparse: the config names no dense MLP's size (the experts' is the MLP's)."""
    return {**raw, "intermediate_size": raw.get("intermediate_size") or raw["moe_intermediate_size"]}


def shared_mlp_when_dense(raw: dict) -> dict:
    """A dense checkpoint of a family whose MoE has a shared MLP: that MLP is the MLP."""
    if raw.get("num_local_experts"):
        return raw
    return {**raw, "intermediate_size": raw["shared_intermediate_size"]}


def causal_only(raw: dict) -> dict:
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (an embedding model) is not supported: a causal decoder only")
    return raw


CONFIG_REWRITES: dict[str, Callable[[dict], dict]] = {
    "sparse_every_layer": sparse_every_layer,
    "shared_mlp_when_dense": shared_mlp_when_dense,
    "causal_only": causal_only,
    "nemotron_h": nemotron_h,
}
