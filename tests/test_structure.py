"""The package's structure, as rules a test keeps from drifting back.

Every `import` in kvrelay/ counts, wherever it stands: at the top, inside a function (a lazy
import is still a dependency) or under `TYPE_CHECKING` (a type a module names is part of what it
depends on).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvrelay"
MAX_FILE_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> Iterator[str]:
    """The kvrelay modules one import statement names."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            yield sub if sub in known else target


def import_graph() -> dict[str, set[str]]:
    """module -> the kvrelay modules it imports (edges to itself left out)."""
    known = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            for target in _imported(node, module, path.name == "__init__.py", known):
                if target in known and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(graph: dict[str, set[str]], sources: str, targets: tuple[str, ...]) -> list[str]:
    return sorted(f"{module} -> {target}" for module, edges in graph.items() if _under(module, sources)
                  for target in edges if any(_under(target, t) for t in targets))


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_kvrelay_takes_part_in_an_import_circle(graph: dict[str, set[str]]) -> None:
    assert circles(graph) == []


KV = "kvrelay.kv_transfer"
CONNECTOR_PACKAGES = (f"{KV}.p2p", f"{KV}.pull", f"{KV}.push", f"{KV}.offload", f"{KV}.reference")


def test_kv_transfer_reads_as_pull_push_offload_reference_transport_and_shared_pieces() -> None:
    folders = {p.name for p in (PACKAGE / "kv_transfer").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"p2p", "pull", "push", "offload", "reference", "transport"}


def test_a_transport_never_imports_a_connector(graph: dict[str, set[str]]) -> None:
    assert _violations(graph, f"{KV}.transport", CONNECTOR_PACKAGES) == []


def test_push_never_imports_pull_and_pull_never_imports_push(graph: dict[str, set[str]]) -> None:
    assert _violations(graph, f"{KV}.push", (f"{KV}.pull",)) == []
    assert _violations(graph, f"{KV}.pull", (f"{KV}.push",)) == []


def test_the_shared_p2p_pieces_import_no_connector(graph: dict[str, set[str]]) -> None:
    assert _violations(graph, f"{KV}.p2p", CONNECTOR_PACKAGES[1:]) == []


@pytest.mark.parametrize("package", ["pull", "push", "offload"])
def test_only_a_connector_package_face_imports_its_facade(graph: dict[str, set[str]], package: str) -> None:
    facade = f"{KV}.{package}.connector"
    importers = sorted(m for m, edges in graph.items() if facade in edges)
    assert importers in ([], [f"{KV}.{package}"]), f"{facade} is imported by its parts: {importers}"


def test_the_scheduler_side_never_imports_torch_or_the_worker_side(graph: dict[str, set[str]]) -> None:
    assert _violations(graph, "kvrelay.core", ("kvrelay.worker", "kvrelay.model", "kvrelay.executor",
                                               "kvrelay.attention", "kvrelay.kernels")) == []
    for path in (PACKAGE / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                 for alias in node.names} | {node.module for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom) and node.module}
        assert not any(name.split(".")[0] == "torch" for name in names), f"{path} imports torch"


def test_the_model_never_imports_the_worker_or_the_engine(graph: dict[str, set[str]]) -> None:
    for layer in ("kvrelay.model", "kvrelay.attention", "kvrelay.kernels"):
        assert _violations(graph, layer, ("kvrelay.worker", "kvrelay.engine", "kvrelay.executor")) == []


def test_the_worker_never_imports_the_executor_or_the_engine(graph: dict[str, set[str]]) -> None:
    assert _violations(graph, "kvrelay.worker", ("kvrelay.executor", "kvrelay.engine")) == []


def test_only_the_vllm_integration_imports_vllm() -> None:
    """kvrelay runs and tests without vLLM: every vLLM import lives in kvrelay/integrations/vllm."""
    importers = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        names |= {node.module for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module}
        if any(name.split(".")[0] == "vllm" for name in names):
            importers.append(str(path.relative_to(PACKAGE)))
    assert importers and all(p.startswith("integrations/vllm/") for p in importers), importers


def test_no_file_of_kvrelay_is_over_the_size_budget() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".h")}
    assert {path: n for path, n in sizes.items() if n > MAX_FILE_LINES} == {}


_IMPORT_EACH = """
import importlib, json, sys
failures = {}
for module in sys.argv[1:]:
    for name in [m for m in sys.modules if m == "kvrelay" or m.startswith("kvrelay.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        # optional transport libraries, and vLLM (only its integration imports it)
        if not any(lib in str(e) for lib in ("nixl", "mooncake", "vllm")):
            failures[module] = repr(e)
print(json.dumps(failures))
"""


def test_every_module_imports_on_its_own() -> None:
    """Each module imports with no other kvrelay module loaded before it (a circle that a
    package's __init__ closes at run time shows up here as a partly initialized module). In a
    child process, so this test's reloads touch no other test's modules."""
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *sorted(_modules())], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {}
