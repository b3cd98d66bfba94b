"""How a flag of the `llmbus` command reads its value: from the command line, else from its
LLMBUS_* variable (--max-num-seqs <- LLMBUS_MAX_NUM_SEQS; argparse converts a string
default with the flag's type), so compose files set variables and `llmbus serve` hands
its children their flags the same way. And the value types flags share."""

from __future__ import annotations

import argparse
import json
import os
import re

ENV_PREFIX = "LLMBUS_"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def env(flag: str, default=None):
    value = os.environ.get(env_name(flag.lstrip("-").replace("-", "_")))
    return default if value in (None, "") else value


def env_flag(flag: str) -> bool:
    return str(env(flag, "")).lower() in ("1", "true", "yes", "on")


def human_int(text: str) -> int:
    """vLLM's sizes: 4096, 32k (x1000), 32K (x1024), 1m, 1M, 1.5k; a whole number of tokens."""
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (4096, 32k = 32000, 32K = 32768)")
    number, unit = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[unit]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def json_object(text: str) -> str:
    """A flag's JSON object, checked here and kept as its text (it travels to the services
    as a variable, as it was typed)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return text


def one_device_size(name: str, size: int) -> int:
    """--pipeline-parallel-size: vLLM's, where only 1 holds here."""
    if size != 1:
        raise ValueError(
            f"{name}={size}: no pipeline parallelism (a model wider than a device: --tensor-parallel-size N); serve "
            f"more requests with more replicas (--workers N, --data-parallel-size N, or `llmbus worker` elsewhere)")
    return size


def one_device(value: str) -> int:
    try:
        return one_device_size("size", int(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
