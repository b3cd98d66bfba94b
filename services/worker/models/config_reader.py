"""What the config reader does for every family: JSON's non-finite floats, a family's
defaults filled in through its transformers config class, a multimodal checkpoint's text
config, sliding windows by layer and the layers without rotary."""

from __future__ import annotations

from services.worker.models.families.registry import (
    ALWAYS_BY_LAYER_TYPE,
    BY_LAYER_TYPE,
    EVERY_LAYER_WINDOWED,
    EXAONES,
    GRANITE_HYBRID,
    LEARNED_POSITIONS,
    OLMO_HYBRID,
    TEXT_CONFIG_AS_RUN,
)


def filled(raw: dict, model_type: str) -> dict:
    """config.json with what it leaves out as transformers' config class fills it in."""
    from transformers import CONFIG_MAPPING

    given = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    from huggingface_hub.errors import StrictDataclassError

    try:
        filled = CONFIG_MAPPING[model_type](**given).to_dict()
    except (TypeError, ValueError, StrictDataclassError) as exc:  # (transformers 5's configs check their fields)
        raise ValueError(f"config.json does not read as transformers' {model_type} config: {exc}") from exc
    return {**filled, "architectures": raw.get("architectures")}


def nope_layers(arch: str, raw: dict) -> tuple[int, ...]:
    """SmolLM3's no_rope_layers: a 1 for each layer that rotates, a 0 for each that does not.
    EXAONE 4's global layers, where it has windowed ones (transformers rotates only those)."""
    if arch in LEARNED_POSITIONS:  # their positions are learned: no layer rotates
        return tuple(range(raw["num_hidden_layers"]))
    if arch in EXAONES and raw.get("sliding_window"):
        return tuple(i for i, kind in enumerate(raw["layer_types"]) if kind == "full_attention")
    if (arch == GRANITE_HYBRID and raw.get("position_embedding_type") != "rope") or arch == "NemotronHForCausalLM":
        # (Granite 4.0-H's attention, and Nemotron-H's: NoPE)
        return tuple(range(raw["num_hidden_layers"]))
    if arch == OLMO_HYBRID and (raw.get("rope_parameters") or {}).get("rope_theta") is None:
        return tuple(range(raw["num_hidden_layers"]))  # (no rope theta: none rotates, as its class)
    if arch == "AfmoeForCausalLM":  # only a windowed layer rotates, window or not
        return tuple(i for i, kind in enumerate(raw["layer_types"]) if kind == "full_attention")
    if arch == "Cohere2ForCausalLM":  # only a windowed layer rotates: without a window, none
        window = raw.get("sliding_window")
        return tuple(i for i, kind in enumerate(raw["layer_types"]) if kind == "full_attention" or not window)
    if arch != "SmolLM3ForCausalLM":
        return ()
    flags = raw["no_rope_layers"]
    if len(flags) < raw["num_hidden_layers"]:
        raise ValueError(f"no_rope_layers must name each of {raw['num_hidden_layers']} layers, got {len(flags)}")
    return tuple(i for i in range(raw["num_hidden_layers"]) if not flags[i])


def text_config(raw: dict, text_models: dict[str, str]) -> dict:
    """A multimodal config's language model, as a config of its own, read as transformers
    reads it: through the outer config class, whose `text_config` fills in what the file
    leaves out (gemma-3-4b-it's names 6 keys) or, where the file has none (Qwen2.5-VL's
    first releases), is built from the outer config's own keys."""
    from transformers import CONFIG_MAPPING

    architecture = raw["architectures"][0]
    given = raw.get("text_config") or {}
    try:
        outer = CONFIG_MAPPING[raw["model_type"]](**{k: v for k, v in raw.items()
                                                     if k not in ("model_type", "transformers_version")})
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"unsupported text_config model_type {given.get('model_type')!r} in {architecture}: "
                         f"{', '.join(text_models)} ({exc})") from exc
    full = outer.get_text_config().to_dict()
    if full["model_type"] not in text_models:
        raise ValueError(f"unsupported text_config model_type {full['model_type']!r} in {architecture}: "
                         f"{', '.join(text_models)}")
    full.update(TEXT_CONFIG_AS_RUN.get(full["model_type"], {}))
    for key in ("bos_token_id", "eos_token_id"):  # Gemma's checkpoints put the ids beside text_config
        if raw.get(key) is not None:
            full[key] = raw[key]
    # Whether the LM head is the embedding is the outer config's say, its class's default
    # where the file is silent (Gemma 3's ties, Qwen-VL's does not): transformers ties by
    # it, whatever text_config holds.
    full["tie_word_embeddings"] = outer.tie_word_embeddings
    return {**full, "architectures": [text_models[full["model_type"]]]}


def sliding_window_fields(arch: str, raw: dict) -> dict:
    """Mistral's, Mixtral's and Phi-3's window on every layer; Qwen's where
    `use_sliding_window` says, on the layers from `max_window_layers` on (or as
    `layer_types` names them): as transformers applies them."""
    window, num_layers = raw.get("sliding_window"), raw["num_hidden_layers"]
    if arch in EVERY_LAYER_WINDOWED and window:
        return dict(layer_windows=layer_windows(["sliding_attention"] * num_layers, window, num_layers))
    if arch in ALWAYS_BY_LAYER_TYPE and window:  # windowed where layer_types says, always
        return dict(layer_windows=layer_windows(raw["layer_types"], window, num_layers))
    if arch in BY_LAYER_TYPE and window and raw.get("use_sliding_window"):
        first = raw.get("max_window_layers", num_layers)
        kinds = raw.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(num_layers)]
        return dict(layer_windows=layer_windows(kinds, window, num_layers))
    return {}


def layer_windows(kinds: list[str], window: int | None, num_layers: int) -> tuple[int, ...]:
    """Each layer's window from transformers' `layer_types` (empty when none slides)."""
    if len(kinds) != num_layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of {num_layers} layers")
    if window is not None and window < 1:
        raise ValueError(f"sliding_window {window} must be at least 1")
    windows = tuple(window if kind == "sliding_attention" and window else 0 for kind in kinds)
    return windows if any(windows) else ()
