"""The package's modules import each other without cycles, deferred imports included.

A cycle that works only because one side imports inside a function (to load a heavy
dependency late, say) still ties the two modules together: whoever changes one must
know the other. What both need goes in a third module (issue 26).
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app"


def module_names() -> dict[str, Path]:
    out = {}
    for path in APP.rglob("*.py"):
        parts = path.relative_to(APP.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The app modules ``path`` imports anywhere in its body (``__init__`` re-exports
    resolved to the module named, where the name is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name in modules:
                    out.add(name)
                elif node.module in modules:
                    out.add(node.module)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    modules = module_names()
    # A module's own package (its __init__) is not an edge: importing a submodule
    # runs its package first in any case.
    graph = {
        name: {m for m in imports(path, modules) if m != name and not name.startswith(m + ".")}
        for name, path in modules.items()
    }
    assert find_cycle(graph) is None


def test_a_cycle_is_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
