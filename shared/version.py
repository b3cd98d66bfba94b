"""The version a running llmbus reports (the gateway's /version): the installed
distribution's, or pyproject.toml's where the code runs from a checkout that was never
installed (PYTHONPATH set to it, as a GPU lease's scripts run it)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path


def llmbus_version() -> str:
    try:
        return importlib.metadata.version("llmbus")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]
