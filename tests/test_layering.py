"""The import graph of executor/, models/ and tools/ has no cycle, and only the NPU adapter
imports torch_npu / torchair.

Why: layers must point one way (config -> platform -> backends -> compile -> runner -> CLI and
tools) so that multi-device, accuracy and compiled-prefill work can replace one layer without
dragging another into a knot. Every import statement counts, also the ones inside functions:
a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("executor", "models", "tools")
ADAPTER_DIR = "executor/backends/"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports (a name that is not a project module is dropped)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        found = _imported_names(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = {m for m in found if m in mods and m != name and not name.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_cycle():  # the check itself can fail
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_sees_lazy_imports():
    graph = import_graph()
    assert "executor.backends.npu" in graph["executor.compile"]  # imported inside select_backend
    assert "executor.registry" in graph["executor.cli"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_npu_adapter_imports_torch_npu_or_torchair():
    offenders = []
    for name, path in _modules().items():
        if str(path.relative_to(REPO)).startswith(ADAPTER_DIR):
            continue
        tree = ast.parse(path.read_text())
        imported = _imported_names(tree, name, path.name == "__init__.py")
        dynamic = {
            n.args[0].value
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", "")) == "import_module"
            and n.args
            and isinstance(n.args[0], ast.Constant)
        }
        if any(m.split(".")[0] in ("torch_npu", "torchair") for m in imported | dynamic):
            offenders.append(name)
    assert offenders == []
