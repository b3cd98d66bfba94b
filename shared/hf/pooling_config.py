"""How a model's embeddings are pooled, as its sentence-transformers files say
(modules.json naming a Pooling module whose config.json sets a `pooling_mode_*`).

The engine pools by the last token (embeddings.py, the worker's embed rows): what
decoder embedding models are trained with, and what a model without those files gets,
as vLLM gives decoder models. One that asks for another mode (mean, cls, max) would get
vectors it was not trained to give, so its embedding requests are refused, by name.
"""

from __future__ import annotations

import json
from pathlib import Path

MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
         "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
         "pooling_mode_weightedmean_tokens": "weighted_mean"}


def pooling_mode(model_path: str | Path) -> str:
    """"last" unless the model's sentence-transformers Pooling config names another mode."""
    folder = Path(model_path)
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return "last"
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            try:
                config = json.loads((folder / module.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                return "last"
            chosen = [mode for key, mode in MODES.items() if config.get(key)]
            return "+".join(chosen) or "last"
    return "last"


def unsupported_pooling(model_path: str | Path) -> str | None:
    """Why this model's embeddings cannot be served as it asks, or None."""
    mode = pooling_mode(model_path)
    if mode == "last":
        return None
    return (f"this model's sentence-transformers config pools its embeddings by {mode}; llmbus pools by the "
            "last token only")
