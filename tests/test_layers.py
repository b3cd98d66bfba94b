"""The layering the tree promises, read from the code's own imports (an AST walk, nothing
imported): floors that import only downwards, NATS only in the shells, no cycle, no
module reaching for another's private names, and the gateway and tokenizer free of torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A floor imports only from floors below it (and itself).
FLOORS = {"kernels": 0, "shared": 1, "services": 2, "llmbus": 3}
# The modules that may import nats: the services' shells, the bus helper they share, and
# what `llmbus serve` deploys.
NATS_ALLOWED = ("services.gateway.shell.", "services.scheduler.shell.", "services.tokenizer.shell.",
                "services.worker.shell.", "shared.bus", "llmbus.deploy.")


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module
    target: str  # the project module imported (a name imported from a module resolved to it)
    name: str  # what was imported, as written
    type_only: bool  # under `if TYPE_CHECKING:`


def project_modules() -> dict[str, Path]:
    modules = {}
    for top in FLOORS:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = project_modules()


def resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> tuple[list[Import], set[str]]:
    """The project imports of a module, and the top-level names of the others it imports."""
    tree = ast.parse(MODULES[module].read_text())
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for n in ast.walk(node))
    found, external = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [(a.name, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [(f"{node.module}.{a.name}", a.name) for a in node.names]
        else:
            continue
        for full, name in names:
            target = resolve(full)
            if target is None:
                external.add(full.split(".")[0])
            elif target != module:
                found.append(Import(module, target, name, id(node) in type_only))
    return found, external


IMPORTS = {m: imports_of(m) for m in MODULES}


def floor(module: str) -> int:
    return FLOORS[module.split(".")[0]]


def cycles(type_only_too: bool) -> list[set[str]]:
    graph = defaultdict(set)
    for module, (found, _) in IMPORTS.items():
        graph[module] |= {i.target for i in found if type_only_too or not i.type_only}
    # Tarjan's strongly connected components, iteratively
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in MODULES:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1; stack.append(start); on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1; stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    m = stack.pop(); on_stack.discard(m); component.add(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def test_the_walk_sees_the_tree():
    # (so the rules below cannot pass by reading nothing)
    assert len(MODULES) > 150
    assert any(i.target == "shared.messages" for i in IMPORTS["services.scheduler.core.scheduler"][0])
    assert "torch" in IMPORTS["services.worker.model_runner"][1]


def test_no_module_imports_from_a_floor_above_its_own():
    upward = [f"{i.source} -> {i.target}" for found, _ in IMPORTS.values() for i in found
              if floor(i.target) > floor(i.source)]
    assert upward == []


def test_no_import_cycle_at_run_time():
    assert cycles(type_only_too=False) == []


def test_no_import_cycle_through_type_checking_imports_either():
    # (a cycle only type annotations close is still a back-reference: an answer once held
    # the whole OpenAIServing; now it takes a ServingContext)
    assert cycles(type_only_too=True) == []


def test_only_the_shells_import_nats():
    importers = sorted(m for m, (_, external) in IMPORTS.items() if "nats" in external)
    assert importers and all(m.startswith(NATS_ALLOWED) for m in importers), importers


def test_no_core_imports_a_shell_and_no_service_imports_another_services_shell():
    wrong = []
    for found, _ in IMPORTS.values():
        for i in found:
            if ".shell" not in i.target or not i.source.startswith("services."):
                continue
            same_service = i.source.split(".")[1] == i.target.split(".")[1]
            if ".shell" not in i.source or not same_service:
                wrong.append(f"{i.source} -> {i.target}")
    assert wrong == []


def test_the_gateway_and_tokenizer_import_nothing_of_the_worker_or_the_scheduler():
    wrong = [f"{i.source} -> {i.target}" for found, _ in IMPORTS.values() for i in found
             if i.source.startswith(("services.gateway", "services.tokenizer"))
             and i.target.startswith(("services.worker", "services.scheduler"))]
    assert wrong == []


def test_no_module_imports_another_modules_private_names():
    private = [f"{i.source}: {i.name} from {i.target}" for found, _ in IMPORTS.values() for i in found
               if i.name.startswith("_") and not i.name.startswith("__")]
    assert private == []


def test_the_gateway_and_tokenizer_services_start_without_torch():
    """Their processes stay small and start fast: importing their services loads no torch
    (the tokenizer's grammar checks import it in a child process of their own)."""
    code = ("import sys\n"
            "import services.gateway.shell.service, services.tokenizer.shell.service, services.gateway.app\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_our_kernels_package_is_never_taken_for_hugging_faces():
    """PyPI's `kernels` (Hugging Face's) has our kernels/ import name, and transformers
    probes for it; with llmbus installed the probe must still say it is absent."""
    code = "from transformers.utils import is_kernels_available\nprint(is_kernels_available())\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_no_file_in_the_engine_passes_400_lines():
    """A file does one thing and stays under 400 lines (the tests aside)."""
    long = {str(path.relative_to(ROOT)): n for top in FLOORS
            for path in (ROOT / top).rglob("*.py") if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}
