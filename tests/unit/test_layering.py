"""The house: every module of easy_context imports only modules of its own layer or of the
layers below it, and no import circle exists (imports inside functions count too: a lazy
import still ties the two modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "easy_context"

# Bottom to top. A module may import its own layer and the ones before it.
LAYERS = [
    {"utils", "errors"},
    {"layouts", "launch", "mesh"},
    {"attention"},
    {"parallel"},
    {"recurrent"},
    {"sequence_parallel", "memory"},
    {"integrations"},
    {"models", "plan", "data", "generation"},
    {"eval", "train"},
    {"recipes"},
    {"demo"},
    {"cli", "compat", "testing", ""},  # "" is easy_context/__init__.py
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the easy_context modules it imports (a name imported from a package counts
    as that submodule when one exists)."""
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _entry_point(module: str) -> bool:
    return module.endswith(".__main__")  # python -m ...: above everything, like the CLI


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_every_area_has_a_layer():
    assert {_area(m) for m in import_graph()} <= set(LEVEL), "add the new area to LAYERS"


def test_no_module_imports_a_layer_above_its_own():
    upward = [(m, d) for m, deps in import_graph().items() if not _entry_point(m)
              for d in deps if LEVEL[_area(d)] > LEVEL[_area(m)]]
    assert upward == []


def test_the_check_sees_a_circle_and_an_upward_import():
    graph = {"easy_context.memory.a": {"easy_context.integrations.b"},
             "easy_context.integrations.b": {"easy_context.memory.a"}}
    assert circles(graph) == [sorted(graph)]
    assert LEVEL["integrations"] > LEVEL["memory"]
    real = import_graph()
    assert "easy_context.parallel.settings" in real["easy_context.memory.maxlen"]  # parsed lazily-imported names
