"""The one reader of a model folder's config.json: every service and command that asks what a
folder holds (its architectures, its dtype, whether it classifies, the decoder's config)
reads it here, the same way."""

from __future__ import annotations

import json
import math
from pathlib import Path


def tagged_float(obj: dict):
    """transformers 5 writes the floats JSON has no literal for as {"__float__": "Infinity"}
    (Granite 4.0-H's time_step_limit), and reads them back so."""
    tag = obj.get("__float__") if len(obj) == 1 else None
    return {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}.get(tag, obj) if isinstance(tag, str) else obj


def read_config(folder: str | Path) -> dict:
    """config.json as a fresh dict (callers may change their copy); ValueError where the
    folder has none or it does not parse as an object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} is not a model folder: it has no config.json")
    try:
        raw = json.loads(path.read_text(), object_hook=tagged_float)
    except ValueError as exc:
        raise ValueError(f"{path} does not parse: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def config_or_empty(folder: str | Path) -> dict:
    """config.json, or {} where the folder has none that reads (a GGUF file, a folder being
    written): for the questions that have an answer without it."""
    try:
        return read_config(folder)
    except (OSError, ValueError):
        return {}


def architectures(folder: str | Path) -> tuple[str, ...]:
    return tuple(str(a) for a in config_or_empty(folder).get("architectures") or ())


def text_config(raw: dict) -> dict:
    """The language model's part of a config (a multimodal checkpoint's text_config)."""
    return raw.get("text_config") or raw


def checkpoint_dtype(folder: str | Path) -> str | None:
    """The dtype the checkpoint names (`dtype`, or `torch_dtype` as transformers 4 wrote it)."""
    raw = config_or_empty(folder)
    name = raw.get("dtype") or raw.get("torch_dtype")
    return str(name) if name else None
