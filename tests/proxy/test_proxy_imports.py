"""pd_proxy's modules import each other without a cycle (function-level imports included).

A cycle works only while every import on it is deferred into a function, so it breaks the day
someone moves one to the top of the file; pd_proxy.cli and pd_proxy.workers.supervisor had one.
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
        # A package's __init__ taking a submodule (`from pkg import sub`) reads as pkg -> pkg:
        # that is Python's own order of loading, not a cycle between modules.
        graph[name] = imports_of(path) - {name}
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
    assert {"pd_proxy.cli", "pd_proxy.workers.supervisor", "pd_proxy.port_reservation"} <= set(
        graph
    )
    assert cycles(graph) == []
    assert "pd_proxy.cli" not in graph["pd_proxy.workers.supervisor"]


def test_cycle_finder_sees_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pd_proxy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pd_proxy.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pd_proxy import a\n")
    assert cycles(module_graph(pkg)) == [["pd_proxy.a", "pd_proxy.b", "pd_proxy.a"]]


def http_literals(path: Path) -> list[str]:
    """Literals in ``path`` that write HTTP/1.x heads: a CRLF or an ``HTTP/1.`` version
    (docstrings and whitespace sets such as ``b" \\t\\r\\n"`` aside)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            if id(node) in docstrings:
                continue
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            crlf = "\r\n" in text and text.strip(" \t\r\n")
            if crlf or "HTTP/1." in text:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_upstream_client_writes_http_bytes() -> None:
    """The legs' wire format lives in pd_proxy.http alone (the upstream pool's request heads and
    the connection's parsing; the test fakes aside), so the client can change without touching
    the pipeline."""
    writers = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "testing" not in path.parts and http_literals(path)
    }
    assert writers <= {"http/upstream.py", "http/connection.py"} and "http/upstream.py" in writers


def test_http_literal_finder_sees_a_head(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        '"""A HTTP/1.1 docstring."""\nHEAD = b"GET / HTTP/1.1\\r\\n"\n'
        'WS = b" \\r\\n"\nLINE = b"X: 1\\r\\n"\n'
    )
    assert http_literals(path) == ["m.py:2", "m.py:4"]
