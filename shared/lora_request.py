"""Which LoRA adapter serves a request (vLLM's `LoRARequest`).

The gateway names an adapter by the request's `model` field (`--lora-modules`); offline,
`LLM.generate(..., lora_request=LoRARequest(...))`. It travels with the request to the
scheduler (its prefix-cache blocks hash under the adapter's name: the same tokens give
other keys and values under another adapter) and to the worker, which reads the adapter
from `lora_path` the first time a request needs it (services/worker/lora/adapter.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

# adapter_config.json options that change what the adapter computes: refused when set.
UNSUPPORTED_OPTIONS = ("use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                       "fan_in_fan_out", "layer_replication", "trainable_token_indices", "target_parameters",
                       "alora_invocation_tokens", "use_qalora", "use_bdlora", "arrow_config")


class LoRARequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    lora_name: str  # what clients call it: the `model` they ask for
    lora_int_id: int  # vLLM's: a positive id, one per adapter
    lora_path: str  # a PEFT folder (adapter_config.json + adapter_model.safetensors) the worker can read

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    def not_served(self) -> str:
        """Why a worker started without --enable-lora cannot serve this request."""
        return f"LoRA adapter {self.lora_name!r}: this worker serves no adapters (start it with --enable-lora)"


def parse_lora_modules(values: list[str], max_rank: int | None = None) -> dict[str, LoRARequest]:
    """vLLM's --lora-modules: each `name=path` or `{"name": ..., "path": ...}`, checked
    here (the folder's adapter_config.json read, its weights file there; its rank against
    `max_rank`, where the workers' is known), so a wrong path fails at start-up rather than at a client's first
    request. Ids are 1, 2, ... in the order given."""
    modules: dict[str, LoRARequest] = {}
    for value in values:
        value = value.strip()
        if value.startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules {value!r}: the JSON form is {{"name": ..., "path": ...}}') from None
        else:
            name, sep, path = value.partition("=")
            if not (sep and name and path):
                raise ValueError(f"--lora-modules {value!r}: give name=path")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = LoRARequest(name, len(modules) + 1, check_adapter(name, path, max_rank))
    return modules


def check_adapter(name: str, path: str, max_rank: int | None = None) -> str:
    """An adapter's folder, resolved, once its config and weights file are there and its
    options are ones llmbus computes; else a ValueError saying what is wrong."""
    check_options(name, read_adapter_config(name, Path(path)), max_rank)
    weights_file(name, Path(path))
    return str(Path(path).resolve())


def weights_file(name: str, folder: Path) -> Path:
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {weights} not found (adapters are read from safetensors only)")
    return weights


def read_adapter_config(name: str, folder: Path) -> dict:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {config_file} not found")
    try:
        options = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is unreadable ({exc})") from None
    if not isinstance(options, dict):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not an object")
    return options


def check_options(name: str, options: dict, max_rank: int | None = None) -> tuple[int, float]:
    """(rank, alpha) of a PEFT LoRA config, or a ValueError naming what llmbus does not
    compute. The gateway checks its --lora-modules with this at start-up (parse_lora_modules)."""
    if str(options.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r} is a {options.get('peft_type')!r} adapter, not LORA")
    bias = options.get("bias", "none")
    if bias not in (None, "none"):
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias {bias!r}): not supported")
    for option in UNSUPPORTED_OPTIONS:
        if options.get(option):
            raise ValueError(f"LoRA adapter {name!r} sets {option}: not supported")
    rank, alpha = options.get("r"), options.get("lora_alpha", options.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r} needs a positive integer r and a numeric lora_alpha")
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    return rank, float(alpha)


