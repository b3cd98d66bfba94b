"""The model maker's sampling defaults, from the model's generation_config.json, as vLLM's
`--generation-config auto` (its default) reads them: a request that leaves temperature,
top_p, top_k, min_p or repetition_penalty out gets the model's value rather than the
neutral one, and `max_new_tokens` is the default max_tokens where a request has none
(chat; a completion's default stays OpenAI's 16). Qwen's models ship temperature 0.7,
top_p 0.8, top_k 20: served without them, they ramble where vLLM's output does not.

Its `eos_token_id` (one id or several) ends a request too, as vLLM's
update_from_generation_config makes it: the ids beyond the tokenizer's EOS join the
request's stop_token_ids unless it ignores EOS. Chat models end a turn with a token the
tokenizer does not call EOS (Gemma's <end_of_turn>, Llama 3's <|eot_id|> where the
tokenizer's is <|end_of_text|>): without it they talk on to max_tokens.

`vllm` (vLLM's spelling) ignores the file; any other value is a folder to read it from.
`--override-generation-config` (JSON, the file's own names) goes on top.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgspec

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
    found = {FIELDS[name]: value for name, value in _read(model_path, source).items()
             if name in FIELDS and value is not None}
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


def model_eos_ids(model_path: str | Path, source: str = "auto") -> tuple[int, ...]:
    """The file's eos_token_id, as a tuple (empty without one)."""
    ids = _read(model_path, source).get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"the model's generation config: eos_token_id {ids!r} is not token ids")
    return tuple(ids)


def stop_at_model_eos(params: SamplingParams, eos_ids: Sequence[int], tokenizer_eos: int | None) -> SamplingParams:
    """`params` with the model's EOS ids other than the tokenizer's among its stop_token_ids
    (vLLM's rule; not with ignore_eos). The same object when nothing is added."""
    extra = [i for i in eos_ids if i != tokenizer_eos and i not in params.stop_token_ids]
    if params.ignore_eos or not extra:
        return params
    return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])


def _read(model_path: str | Path, source: str) -> dict:
    if source == "vllm":
        return {}
    path = Path(model_path if source == "auto" else source) / "generation_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    if source != "auto":
        raise ValueError(f"--generation-config {source}: no generation_config.json there")
    return {}
