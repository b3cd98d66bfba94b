"""The model maker's sampling defaults, from the model's generation_config.json, as vLLM's
`--generation-config auto` (its default) reads them: a request that leaves temperature,
top_p, top_k, min_p or repetition_penalty out gets the model's value rather than the
neutral one, and `max_new_tokens` is the default max_tokens where a request has none
(chat; a completion's default stays OpenAI's 16). Qwen's models ship temperature 0.7,
top_p 0.8, top_k 20: served without them, they ramble where vLLM's output does not.

`vllm` (vLLM's spelling) ignores the file; any other value is a folder to read it from.
`--override-generation-config` (JSON, the file's own names) goes on top.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.sampling_params import SamplingParams

# generation_config.json's name -> SamplingParams' name
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
SOURCES_HELP = "auto: the model folder's generation_config.json; vllm: none; else a folder holding one"


def default_sampling(model_path: str | Path, source: str = "auto", overrides: dict | str | None = None) -> dict:
    """SamplingParams fields the model recommends, by SamplingParams' names. Raises
    ValueError naming what is wrong (a folder without the file, an unknown override, a
    value SamplingParams refuses)."""
    found: dict = {}
    if source != "vllm":
        path = Path(model_path if source == "auto" else source) / "generation_config.json"
        if path.is_file():
            found = {FIELDS[name]: value for name, value in json.loads(path.read_text()).items()
                     if name in FIELDS and value is not None}
        elif source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
    if isinstance(overrides, str):
        overrides = json.loads(overrides) if overrides.strip() else {}
    for name, value in (overrides or {}).items():
        if name not in FIELDS:
            raise ValueError(f"--override-generation-config: unknown field {name!r}; known: {', '.join(FIELDS)}")
        found[FIELDS[name]] = value
    try:
        SamplingParams(**found)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the model's generation config: {exc}") from exc
    return found
