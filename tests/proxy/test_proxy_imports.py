"""pd_proxy's modules import each other without a cycle (function-level imports included).

A cycle works only while every import on it is deferred into a function, so it breaks the day
someone moves one to the top of the file; pd_proxy.cli and pd_proxy.workers had one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pd_proxy

PACKAGE = Path(pd_proxy.__file__).resolve().parent


def imports_of(path: Path) -> set[str]:
    """pd_proxy modules ``path`` imports anywhere in it (top level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pd_proxy.")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "pd_proxy":
                found |= {f"pd_proxy.{a.name}" for a in node.names}
            elif node.module.startswith("pd_proxy."):
                found.add(node.module)
    return found


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    graph = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = imports_of(path)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each once, as the list of modules on it."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                loop = path[path.index(nxt) :]
                if frozenset(loop) not in seen:
                    seen.add(frozenset(loop))
                    found.append([*loop, nxt])
            elif len(path) < len(graph):
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def test_pd_proxy_has_no_import_cycle() -> None:
    graph = module_graph()
    assert {"pd_proxy.cli", "pd_proxy.workers", "pd_proxy.listen"} <= set(graph)
    assert cycles(graph) == []
    assert "pd_proxy.cli" not in graph["pd_proxy.workers"]


def test_cycle_finder_sees_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pd_proxy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pd_proxy.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pd_proxy import a\n")
    assert cycles(module_graph(pkg)) == [["pd_proxy.a", "pd_proxy.b", "pd_proxy.a"]]
